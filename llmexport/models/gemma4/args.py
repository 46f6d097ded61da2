"""Gemma4 text decoder: typed arguments read from config.json and checked against weights.

Every quirk of the family is an explicit field here (per-layer head_dim and KV heads, which
layer's KV cache a shared layer reads, K=V, PLE width, MoE sizes), read from the config and
then checked against the safetensors shapes. Nothing is guessed per model size.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from llmexport.errors import InputError
from llmexport.models.config_values import flag_value as _flag
from llmexport.models.config_values import float_value as _float
from llmexport.models.config_values import int_value as _int
from llmexport.models.gemma4.media import bidirectional_vision
from llmexport.models.layer_types import FULL, SLIDING, read_layer_types, rope_specs
from llmexport.models.rope import RopeSpec
from llmexport.models.shape import DecoderShape

log = logging.getLogger(__name__)
__all__ = ["FULL", "SLIDING", "Gemma4TextArgs", "LayerSpec", "MoESpec", "parse_text_args"]


@dataclass(frozen=True)
class LayerSpec:
    index: int
    kind: str  # SLIDING or FULL
    head_dim: int
    kv_heads: int
    kv_source: int  # -1: computes its own K/V; else the layer whose KV cache it reads
    k_eq_v: bool  # values come from k_proj (no v_proj)
    mlp_width: int
    stores_kv: bool  # another layer reads this layer's cache

    @property
    def shares_kv(self) -> bool:
        return self.kv_source >= 0


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    width: int


@dataclass(frozen=True)
class Gemma4TextArgs(DecoderShape):
    prefix: str  # weight-name prefix of the text decoder ("model.language_model." / "model.")
    sliding_window: int
    layers: tuple[LayerSpec, ...]
    rope: dict[str, RopeSpec]
    ple_dim: int  # 0: no per-layer embeddings
    ple_vocab: int
    final_softcap: float | None
    activation: str
    moe: MoESpec | None
    pad_token_id: int
    bidirectional_vision: bool = False  # image spans attend both ways on sliding layers (gemma4/media.py)

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.hidden_size)


def _kv_sources(layer_types: list[str], num_shared: int, where: str) -> tuple[list[int], set[int]]:
    """Which layer each KV-shared layer reads (HF Gemma4TextConfig.kv_sharing_modes): a shared
    layer reuses the cache of the last non-shared layer of the same attention type."""
    n = len(layer_types)
    first_shared = n - num_shared
    if not 0 <= num_shared < n:
        raise InputError(f"{where}: num_kv_shared_layers={num_shared} invalid for {n} layers")
    last_of_type: dict[str, int] = {}
    for j in range(first_shared):
        last_of_type[layer_types[j]] = j
    sources = [-1] * n
    for i in range(first_shared, n):
        if layer_types[i] not in last_of_type:
            raise InputError(f"{where}: shared layer {i} ({layer_types[i]}) has no earlier layer of its type")
        sources[i] = last_of_type[layer_types[i]]
    return sources, set(sources[first_shared:])


def parse_text_args(config: dict[str, Any], prefix: str, where: str, max_layers: int | None = None) -> Gemma4TextArgs:
    """The text decoder's arguments; ``max_layers`` bounds the layer count before anything is
    sized by it (a checkpoint cannot have more layers than tensors)."""
    cfg = config
    n = _int(cfg, "num_hidden_layers", where, maximum=max_layers)
    hidden, heads = (_int(cfg, k, where) for k in ("hidden_size", "num_attention_heads"))
    layer_types = read_layer_types(cfg, n, where)
    if layer_types[-1] != FULL:  # HF Gemma4TextConfig.__post_init__ forces it (with a warning)
        log.warning("%s: the last layer is %s; transformers runs it as %s, and so does the export", where,
                    layer_types[-1], FULL)
        layer_types = [*layer_types[:-1], FULL]
    per_layer = _per_layer_overrides(_per_layer_config(cfg, layer_types, where), layer_types, where)
    sources, stores = _kv_sources(layer_types, _int(cfg, "num_kv_shared_layers", where, 0, minimum=0), where)
    k_eq_v = _flag(cfg, "attention_k_eq_v", where, False)
    width = _int(cfg, "intermediate_size", where)
    double_wide = _flag(cfg, "use_double_wide_mlp", where, False)
    layers = []
    for i, kind in enumerate(layer_types):
        merged = {**cfg, **per_layer.get(i, {})}
        head_dim, kv_heads = _int(merged, "head_dim", where), _int(merged, "num_key_value_heads", where)
        if head_dim % 2 or heads % kv_heads:
            raise InputError(f"{where}: layer {i}: head_dim {head_dim} must be even and "
                             f"{heads} heads divisible by {kv_heads} KV heads")
        layers.append(LayerSpec(
            index=i, kind=kind, head_dim=head_dim, kv_heads=kv_heads,
            kv_source=sources[i], k_eq_v=k_eq_v and kind == FULL,
            mlp_width=width * (2 if double_wide and sources[i] >= 0 else 1),
            stores_kv=i in stores,
        ))
    rope = rope_specs(cfg, layers, where, ("default", "proportional"))
    moe = None
    if _flag(cfg, "enable_moe_block", where, False):
        moe = MoESpec(*(_int(cfg, k, where) for k in ("num_experts", "top_k_experts", "moe_intermediate_size")))
        if moe.top_k > moe.num_experts:
            raise InputError(f"{where}: top_k_experts {moe.top_k} > num_experts {moe.num_experts}")
    vocab = _int(cfg, "vocab_size", where)
    activation = cfg.get("hidden_activation", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        raise InputError(f"{where}: hidden_activation {activation!r} is not supported (gelu_pytorch_tanh)")
    return Gemma4TextArgs(
        prefix=prefix, vocab_size=vocab, hidden_size=hidden, num_heads=heads,
        eps=_float(cfg, "rms_norm_eps", where, 1e-6, high=1.0), sliding_window=_int(cfg, "sliding_window", where, 0, 0),
        layers=tuple(layers), rope=rope, ple_dim=_int(cfg, "hidden_size_per_layer_input", where, 0, 0),
        ple_vocab=_int(cfg, "vocab_size_per_layer_input", where, vocab),
        final_softcap=_float(cfg, "final_logit_softcapping", where, None),
        tie_embeddings=_flag(cfg, "tie_word_embeddings", where, True),
        activation=activation, moe=moe,
        max_position_embeddings=_int(cfg, "max_position_embeddings", where, 131072),
        pad_token_id=_int(cfg, "pad_token_id", where, 0, 0),
        bidirectional_vision=bidirectional_vision(cfg, where),
    )


def _per_layer_config(cfg: dict[str, Any], layer_types: list[str], where: str) -> Any:
    """``per_layer_config``, or what transformers derives without it (Gemma4TextConfig.__post_init__):
    full layers take ``global_head_dim`` (default 512) and, with K=V, ``num_global_key_value_heads``."""
    if "per_layer_config" in cfg:
        return cfg["per_layer_config"] or {}
    overrides = {"head_dim": _int(cfg, "global_head_dim", where, 512)}
    if cfg.get("num_global_key_value_heads") is not None and _flag(cfg, "attention_k_eq_v", where, False):
        overrides["num_key_value_heads"] = _int(cfg, "num_global_key_value_heads", where)
    return {str(i): dict(overrides) for i, kind in enumerate(layer_types) if kind == FULL}


def _per_layer_overrides(raw: Any, layer_types: list[str], where: str) -> dict[int, dict[str, Any]]:
    """``per_layer_config`` keyed by layer index (transformers writes "3" or "03") or by layer type."""
    if not isinstance(raw, dict):
        raise InputError(f"{where}: 'per_layer_config' must be an object keyed by layer index")
    out: dict[int, dict[str, Any]] = {}
    for key, value in raw.items():
        if not isinstance(value, dict):
            raise InputError(f"{where}: per_layer_config[{key!r}] must be an object")
        if str(key).isdigit() and int(key) < len(layer_types):
            out.setdefault(int(key), {}).update(value)
        elif key in (SLIDING, FULL):
            for i, kind in enumerate(layer_types):
                if kind == key:
                    out.setdefault(i, {}).update(value)
        else:
            raise InputError(f"{where}: per_layer_config key {key!r} is not a layer index or layer type")
    return out
