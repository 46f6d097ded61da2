"""Qwen3-VL's text graph: Qwen3's decoder (decoder/graph.py ``DenseDecoderGraph``; Qwen3-VL-MoE's
sparse layers as Qwen3-MoE's) on the runtime's M-RoPE positions, plus DeepStack.

Mirrors transformers 5.x models/qwen3_vl/modeling_qwen3_vl.py ``Qwen3VLTextModel``:
- ``Qwen3VLTextRotaryEmbedding`` takes each rotary pair's angle from the t, h or w position row,
  interleaved by ``mrope_section`` (the same recomposition as Qwen3.5's, qwen_vl/mrope.py, which
  also undoes where MNN 3.6.1's runtime positions differ from ``get_rope_index``);
- after decoder layer ``i < len(deepstack_visual_embeds)`` HF adds level ``i`` of the tower's
  DeepStack features to the image tokens' hidden states (``_deepstack_process``). The graph's
  fifth input ``deepstack_embeds`` [levels, seq, hidden] is what omni.cpp ``Omni::embedding``
  builds from the visual graph's second output, zeros at text tokens, so the graph adds level
  ``i`` to every token after layer ``i``. A decode step, and a prompt without an image, get the
  runtime's zeros [3, 1, 1], which broadcast; without the input (eager calls with the standard
  four) nothing is added.
"""

from __future__ import annotations

import torch

from llmexport.models.decoder.args import DecoderArgs
from llmexport.models.decoder.graph import DenseDecoderGraph
from llmexport.models.graph_parts import TensorLookup
from llmexport.models.qwen_vl.mrope import hf_relative_positions, mrope_cos_sin, pair_rows
from llmexport.models.tensor_names import NameTable


class Qwen3VLGraph(DenseDecoderGraph):
    """``section``: rotary pairs per position row (t, h, w); ``levels``: the DeepStack levels;
    ``stacked``: Qwen3-VL-MoE's routed experts, rows of stacked tensors (``DenseDecoderGraph``)."""

    pair_rows: torch.Tensor

    def __init__(self, args: DecoderArgs, names: NameTable, lookup: TensorLookup, section: tuple[int, int, int],
                 levels: int, stacked: bool = False):
        super().__init__(args, names, lookup, stacked)
        self.levels = levels
        self.register_buffer("pair_rows", pair_rows(section, args.head_dim // 2), persistent=False)

    def rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return mrope_cos_sin(hf_relative_positions(position_ids), self.inv_freq, self.pair_rows)

    def after_layer(self, index: int, x: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        if not extra or index >= self.levels:
            return x
        return x + extra[0][index]  # [seq, hidden] (or the decode step's [1, 1]) onto [1, seq, hidden]
