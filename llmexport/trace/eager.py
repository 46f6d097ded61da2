"""Run a rewritten graph eagerly, the way MNN's runtime feeds it (for parity checks).

``prompt_inputs`` mirrors MNN 3.6.1 ``Llm::embedding`` / ``gen_attention_mask`` /
``gen_position_ids`` (transformers/llm/engine/src/llm.cpp) for one prompt without a cache:
unscaled embeddings as [seq, 1, hidden], a float mask (stacked full + sliding for "mix"),
int32 positions; with per-layer embeddings each row is the token's embedding followed by its
(unscaled) PLE row, as the runtime reads them from one table (mnn/token_table.py).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from llmexport.models.base import Architecture
from llmexport.source.safetensors_file import LazyTensor
from llmexport.trace.ops import PlaceholderLinear

WeightFn = Callable[[str], tuple[torch.Tensor, torch.Tensor | None]]


def placeholders(graph: nn.Module) -> list[PlaceholderLinear]:
    return [m for m in graph.modules() if isinstance(m, PlaceholderLinear)]


def bind_weights(graph: nn.Module, weight_fn: WeightFn) -> nn.Module:
    """Attach real weights (fp32 copies) to every placeholder of ``graph``."""
    for linear in placeholders(graph):
        weight, bias = weight_fn(linear.name)
        linear.bind(weight.float().clone(), None if bias is None else bias.float().clone())
    return graph


def _causal(seq: int, window: int | None) -> torch.Tensor:
    q = torch.arange(seq).view(-1, 1)
    k = torch.arange(seq).view(1, -1)
    allowed = k <= q
    if window:
        allowed &= k > q - window
    lowest = torch.finfo(torch.float32).min
    return torch.where(allowed, 0.0, lowest).view(1, 1, seq, seq)


def _rows(table, ids: torch.Tensor) -> torch.Tensor:
    return table.take(ids) if isinstance(table, LazyTensor) else table[ids]


def prompt_inputs(arch: Architecture, ids: torch.Tensor, embedding: torch.Tensor,
                  ple: torch.Tensor | None, all_logits: bool = True) -> tuple[torch.Tensor, ...]:
    """Graph inputs for a whole prompt; ``embedding``/``ple`` are the tables the runtime reads."""
    config = arch.llm_config()
    seq = int(ids.numel())
    ids = ids.view(-1).long()
    embeds = _rows(embedding, ids).float().view(seq, 1, -1)
    if ple is not None:
        embeds = torch.cat([embeds, _rows(ple, ids).float().view(seq, 1, -1)], dim=-1)
    if config.get("attention_type") == "mix":
        mask = torch.stack([_causal(seq, None), _causal(seq, int(config["sliding_window"]))])
    else:
        mask = _causal(seq, None)
    positions = torch.arange(seq, dtype=torch.int32).view(1, -1)
    if config.get("is_mrope"):  # llm.cpp gen_position_ids: three equal rows for a text prompt
        positions = positions.repeat(3, 1)
    logits_index = torch.tensor([0 if all_logits else -1], dtype=torch.int32)
    return embeds, mask, positions, logits_index
