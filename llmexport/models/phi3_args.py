"""Phi-3 (``phi3``): typed arguments from config.json, read through transformers' ``Phi3Config``;
longrope's short factors and attention factor, the exported context (phi3.py), and the sliding
window every layer uses when ``sliding_window`` is set (Phi3Model masks all layers with
``create_sliding_window_causal_mask`` then; Phi-3-mini-4k's 2047)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from llmexport.errors import InputError
from llmexport.models.config_values import flag_value, float_value, int_value, str_value
from llmexport.models.decoder.args import EVERY_LAYER, resolve_config, sliding_layers
from llmexport.models.shape import UniformAttentionShape

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Phi3Args(UniformAttentionShape):
    rotary_dim: int
    inv_freq: tuple[float, ...]  # the short (or default) table, rotary_dim / 2 entries
    attention_factor: float  # longrope's cos/sin scaling
    # max_position_embeddings: the exported context: original_max_position_embeddings with longrope
    layers: tuple[int, ...]
    sliding_window: int = 0  # every layer attends to the last this many keys (0: full attention)


def parse_phi3_args(raw: dict[str, Any], where: str, max_layers: int | None = None) -> Phi3Args:
    from transformers import Phi3Config

    cfg = resolve_config(Phi3Config, raw, where)
    if cfg.get("hidden_act") != "silu":
        raise InputError(f"{where}: hidden_act {cfg.get('hidden_act')!r} is not supported (silu)")
    n = int_value(cfg, "num_hidden_layers", where, maximum=max_layers)
    hidden, heads = int_value(cfg, "hidden_size", where), int_value(cfg, "num_attention_heads", where)
    kv_heads = int_value(cfg, "num_key_value_heads", where)
    head_dim = int_value(cfg, "head_dim", where, hidden // heads)
    if heads % kv_heads or head_dim % 2:
        raise InputError(f"{where}: num_attention_heads {heads} must be a multiple of num_key_value_heads {kv_heads}")
    params = cfg.get("rope_parameters")
    if not isinstance(params, dict):
        raise InputError(f"{where}: 'rope_parameters' must be an object")
    label = f"{where}: rope_parameters"
    rope_type = str_value(params, "rope_type", label, "default", ("default", "longrope"))
    theta = float_value(params, "rope_theta", label, 10000.0)
    rotary_dim = int(head_dim * float_value(params, "partial_rotary_factor", label, 1.0, high=1.0))
    if rotary_dim % 2:
        raise InputError(f"{label}: partial_rotary_factor gives an odd rotary dimension {rotary_dim}")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (theta ** exponents)
    attention_factor, context = 1.0, int_value(cfg, "max_position_embeddings", where, 4096)
    if rope_type == "longrope":
        original = int_value(params, "original_max_position_embeddings", label,
                             int_value(cfg, "original_max_position_embeddings", where, context))
        short = params.get("short_factor")
        if not isinstance(short, list) or len(short) != rotary_dim // 2:
            raise InputError(f"{label}: 'short_factor' must list {rotary_dim // 2} numbers")
        inv_freq = inv_freq / torch.tensor([float(x) for x in short], dtype=torch.float32)
        factor = float_value(params, "factor", label, context / original)
        default_af = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
        attention_factor = float_value(params, "attention_factor", label, default_af)
        if context > original:
            log.warning("%s: longrope: exported with the short factors, exact up to original_max_position_embeddings "
                        "%d (llm_config.json max_position_embeddings); past it transformers switches to long_factor "
                        "and recomputes the cache, which MNN's KV cache cannot (max_position_embeddings %d)",
                        where, original, context)
        context = min(context, original)
    return Phi3Args(
        vocab_size=int_value(cfg, "vocab_size", where), hidden_size=hidden,
        intermediate_size=int_value(cfg, "intermediate_size", where), num_heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, rotary_dim=rotary_dim, eps=float_value(cfg, "rms_norm_eps", where, 1e-5, high=1.0),
        inv_freq=tuple(inv_freq.tolist()), attention_factor=attention_factor,
        tie_embeddings=flag_value(cfg, "tie_word_embeddings", where, False), max_position_embeddings=context,
        layers=tuple(range(n)), sliding_window=sliding_layers(cfg, n, where, EVERY_LAYER)[1])
