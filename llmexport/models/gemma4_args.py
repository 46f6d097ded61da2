"""Gemma4 text decoder: typed arguments read from config.json and checked against weights.

Every quirk of the family is an explicit field here (per-layer head_dim and KV heads, which
layer's KV cache a shared layer reads, K=V, PLE width, MoE sizes), read from the config and
then checked against the safetensors shapes. Nothing is guessed per model size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from llmexport.errors import InputError

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class RopeSpec:
    """One RoPE table: rotate-half layout over ``head_dim`` with ``rotated_pairs`` live pairs.

    HF's "proportional" RoPE (full layers) keeps the frequency of pair i (dims i and
    i + head_dim/2) for i < rotated_pairs and zeroes the rest (transformers
    modeling_rope_utils._compute_proportional_rope_parameters); "default" rotates every pair.
    """

    theta: float
    head_dim: int
    rotated_pairs: int
    factor: float = 1.0

    def inv_freq(self) -> torch.Tensor:
        live = 1.0 / (self.theta ** (torch.arange(0, 2 * self.rotated_pairs, 2, dtype=torch.int64).float()
                                     / self.head_dim))
        dead = torch.zeros(self.head_dim // 2 - self.rotated_pairs)
        return torch.cat([live, dead]) / self.factor


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
class Gemma4TextArgs:
    prefix: str  # weight-name prefix of the text decoder ("model.language_model." / "model.")
    vocab_size: int
    hidden_size: int
    num_heads: int
    eps: float
    sliding_window: int
    layers: tuple[LayerSpec, ...]
    rope: dict[str, RopeSpec]
    ple_dim: int  # 0: no per-layer embeddings
    ple_vocab: int
    final_softcap: float | None
    tie_embeddings: bool
    activation: str
    moe: MoESpec | None
    max_position_embeddings: int
    pad_token_id: int

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.hidden_size)


def _require(cfg: dict[str, Any], key: str, kind: type | tuple, where: str) -> Any:
    value = cfg.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise InputError(f"{where}: '{key}' missing or not {getattr(kind, '__name__', kind)}")
    return value


def _kv_sources(layer_types: list[str], num_shared: int, where: str) -> tuple[list[int], set[int]]:
    """Which layer each KV-shared layer reads (HF Gemma4TextConfig.kv_sharing_modes): a shared
    layer reuses the cache of the last non-shared layer of the same attention type."""
    n = len(layer_types)
    first_shared = n - num_shared
    if not 0 <= num_shared < n:
        raise InputError(f"{where}: num_kv_shared_layers={num_shared} invalid for {n} layers")
    sources = [-1] * n
    stores: set[int] = set()
    for i in range(first_shared, n):
        candidates = [j for j in range(first_shared) if layer_types[j] == layer_types[i]]
        if not candidates:
            raise InputError(f"{where}: shared layer {i} ({layer_types[i]}) has no earlier layer of its type")
        sources[i] = candidates[-1]
        stores.add(candidates[-1])
    return sources, stores


def parse_text_args(config: dict[str, Any], prefix: str, where: str) -> Gemma4TextArgs:
    cfg = config
    n = _require(cfg, "num_hidden_layers", int, where)
    hidden = _require(cfg, "hidden_size", int, where)
    heads = _require(cfg, "num_attention_heads", int, where)
    layer_types = cfg.get("layer_types")
    if not isinstance(layer_types, list) or len(layer_types) != n or set(layer_types) - {SLIDING, FULL}:
        raise InputError(f"{where}: 'layer_types' must list {n} of {SLIDING!r}/{FULL!r}")
    per_layer = _per_layer_overrides(cfg.get("per_layer_config") or {}, layer_types, where)
    sources, stores = _kv_sources(layer_types, int(cfg.get("num_kv_shared_layers") or 0), where)
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    width = _require(cfg, "intermediate_size", int, where)
    double_wide = bool(cfg.get("use_double_wide_mlp", False))
    layers = []
    for i, kind in enumerate(layer_types):
        override = per_layer.get(i, {})
        layers.append(LayerSpec(
            index=i, kind=kind,
            head_dim=int(override.get("head_dim", _require(cfg, "head_dim", int, where))),
            kv_heads=int(override.get("num_key_value_heads", _require(cfg, "num_key_value_heads", int, where))),
            kv_source=sources[i], k_eq_v=k_eq_v and kind == FULL,
            mlp_width=width * (2 if double_wide and sources[i] >= 0 else 1),
            stores_kv=i in stores,
        ))
    rope = _rope_specs(cfg, layers, where)
    moe = None
    if cfg.get("enable_moe_block"):
        moe = MoESpec(_require(cfg, "num_experts", int, where), _require(cfg, "top_k_experts", int, where),
                      _require(cfg, "moe_intermediate_size", int, where))
    ple_dim = int(cfg.get("hidden_size_per_layer_input") or 0)
    vocab = _require(cfg, "vocab_size", int, where)
    return Gemma4TextArgs(
        prefix=prefix, vocab_size=vocab, hidden_size=hidden, num_heads=heads,
        eps=float(cfg.get("rms_norm_eps", 1e-6)), sliding_window=int(cfg.get("sliding_window") or 0),
        layers=tuple(layers), rope=rope, ple_dim=ple_dim,
        ple_vocab=int(cfg.get("vocab_size_per_layer_input") or vocab),
        final_softcap=cfg.get("final_logit_softcapping"),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        activation=str(cfg.get("hidden_activation", "gelu_pytorch_tanh")), moe=moe,
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 131072),
        pad_token_id=int(cfg.get("pad_token_id") or 0),
    )


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


def _rope_specs(cfg: dict[str, Any], layers: list[LayerSpec], where: str) -> dict[str, RopeSpec]:
    params = cfg.get("rope_parameters")
    if not isinstance(params, dict):
        raise InputError(f"{where}: 'rope_parameters' must map layer types to RoPE settings")
    specs = {}
    for kind in sorted({layer.kind for layer in layers}):  # sorted: trace order must be deterministic
        p = params.get(kind)
        if not isinstance(p, dict) or "rope_theta" not in p:
            raise InputError(f"{where}: rope_parameters[{kind!r}] needs 'rope_theta'")
        head_dim = next(layer.head_dim for layer in layers if layer.kind == kind)
        rope_type = p.get("rope_type", "default")
        if rope_type == "default":
            pairs = head_dim // 2
        elif rope_type == "proportional":
            pairs = int(float(p.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        else:
            raise InputError(f"{where}: rope_type {rope_type!r} for {kind} is not supported "
                             "(supported: default, proportional)")
        specs[kind] = RopeSpec(float(p["rope_theta"]), head_dim, pairs, float(p.get("factor", 1.0)))
    return specs
