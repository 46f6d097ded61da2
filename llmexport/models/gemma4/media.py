"""Bidirectional attention over image spans (``text_config.use_bidirectional_attention: "vision"``).

HF (``Gemma4Model.forward`` -> ``create_masks_for_vision_model``, transformers 5.x): on sliding
layers the soft tokens of one image attend to each other both ways, i.e. the mask is
AND(sliding window, OR(causal, same image)); full layers stay causal; audio spans stay causal.
Image spans are the runs of image soft tokens (``mm_token_type_ids == 1``).

MNN 3.6.1 builds the attention mask from positions alone (``Llm::gen_attention_mask``: causal,
plus the sliding window for "mix"); the text graph sees only the embeddings, not the token ids.
So the exported vision tower marks its soft tokens: ``visual.mnn`` multiplies its output by
``MEDIA_MARK`` (a power of two, so the runtime's own ``* 1/39.25`` and the graph's division are
exact), and the text graph, before anything else, finds rows whose largest magnitude exceeds
``MARK_THRESHOLD`` (no embedding row comes near it; every soft token far exceeds it), divides
them back, and opens its sliding-layer mask between soft tokens of the same run. The CPU
attention kernel adds whatever float mask it is given, including future positions.

Limits: a run split between two prefill chunks (the runtime's ``chunk`` setting; off by
default) cannot see across the split; the marker needs fp32 tower activations (the exported
``mllm`` block asks for them).
"""

from __future__ import annotations

from typing import Any

import torch

from llmexport.errors import InputError

MEDIA_MARK = 2.0 ** 40
MARK_THRESHOLD = 2.0 ** 20
KEY = "use_bidirectional_attention"


def bidirectional_vision(text_config: dict[str, Any], where: str) -> bool:
    """Whether image spans attend bidirectionally; refuses settings a causal LM export cannot honour."""
    value = text_config.get(KEY)
    if value is None:
        return False
    if value == "vision":
        return True
    if value == "all":
        raise InputError(f"{where}: text_config {KEY!r} is 'all' (every token attends both ways: an encoder, "
                         "not a causal language model); MNN's LLM runtime decodes causally, so it cannot be exported")
    raise InputError(f"{where}: text_config {KEY!r} must be null, 'vision' or 'all', got {value!r}")


def unmark_media(embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """embeds [seq, 1, hidden] as the runtime feeds them -> (the true embeddings, marked [seq] bool)."""
    marked = embeds.abs().amax(dim=-1, keepdim=True) > MARK_THRESHOLD
    # Divided by a tensor, not by a constant: MNN's converter turns a constant divisor into a
    # multiplication by its reciprocal, and the graph JSON keeps six decimals (2^-40 -> 0).
    divisor = torch.where(marked, torch.full_like(embeds[..., :1], MEDIA_MARK), torch.ones_like(embeds[..., :1]))
    return embeds / divisor, marked.view(-1)


def open_media_spans(mask: torch.Tensor, marked: torch.Tensor) -> torch.Tensor:
    """A sliding-layer mask [1, 1, seq, kv] with future keys of the query's own image run unmasked.

    The current tokens are the last ``seq`` keys (earlier keys are the KV cache). Past keys keep
    the runtime's mask: HF's sliding window bounds them in the image run too, and causality
    already admits them. Runs: HF ``get_block_sequence_ids_for_mask`` (a run starts at a marked
    token whose predecessor is unmarked).
    """
    seq, kv = mask.shape[-2], mask.shape[-1]
    m = marked.to(torch.int32)
    previous = torch.cat([torch.zeros_like(m[:1]), m[:-1]])
    run = torch.cumsum(m * (1 - previous), dim=0)  # run id of each marked token
    keys = torch.arange(kv) - (kv - seq)  # key index within the current tokens (< 0: cache)
    local = keys.clamp(min=0)
    key_run = torch.where(keys >= 0, run[local] * m[local], torch.zeros_like(keys, dtype=run.dtype))
    query_run = run * m
    queries = torch.arange(seq).view(-1, 1)
    same_run = (query_run.view(-1, 1) == key_run.view(1, -1)) & (query_run.view(-1, 1) > 0)
    allowed = same_run & (keys.view(1, -1) > queries)
    return torch.where(allowed.view(1, 1, seq, kv), torch.zeros_like(mask), mask)
