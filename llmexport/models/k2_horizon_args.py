"""K2-Horizon: typed arguments read from config.json (checked against weights in k2_horizon.py).

Every structural choice of the family is an explicit field: GroupedRMSNorm groups, per-head
q/k norm, which layers are sparse (MoE FFN + MoVA attention), both routers' settings. The
semantics are those of ``llmexport/reference/k2_horizon`` (the remote code checkpoints ship).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from llmexport.errors import InputError
from llmexport.reference.k2_horizon.configuration_k2_horizon import K2HorizonConfig

# A key missing from config.json takes the reference configuration's default, exactly as the
# remote code the checkpoint ships would (transformers may leave default values out).
_DEFAULTS = {name: p.default for name, p in inspect.signature(K2HorizonConfig.__init__).parameters.items()
             if p.default is not inspect.Parameter.empty}

SCORING_FUNCS = ("sigmoid", "softmax")


@dataclass(frozen=True)
class RouterSpec:
    """A top-k router: scores (sigmoid|softmax, fp32) choose by score + bias, weigh unbiased,
    optionally normalised to sum 1, then scaled."""

    num_experts: int
    top_k: int
    scoring: str
    normalize: bool
    scale: float


@dataclass(frozen=True)
class LayerSpec:
    index: int
    sparse: bool  # MoE FFN instead of the dense SwiGLU MLP
    mova: bool  # values from v_router + v_experts instead of v_proj (sparse layers only)


@dataclass(frozen=True)
class K2HorizonArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    kv_heads: int
    head_dim: int
    eps: float
    norm_groups: int
    qk_norm: bool
    attention_bias: bool
    rope_theta: float
    max_position_embeddings: int
    tie_embeddings: bool
    layers: tuple[LayerSpec, ...]
    moe: RouterSpec | None
    moe_width: int  # routed expert intermediate size
    shared_width: int  # num_shared_experts * moe_intermediate_size (0: no shared experts)
    mova: RouterSpec | None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim


def _get(cfg: dict[str, Any], key: str) -> Any:
    value = cfg.get(key)
    return _DEFAULTS.get(key) if value is None else value


def _int(cfg: dict[str, Any], key: str, where: str, default: int | None = None, minimum: int = 1) -> int:
    value = _get(cfg, key)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InputError(f"{where}: '{key}' must be an integer >= {minimum} (got {value!r})")
    return value


def _router(cfg: dict[str, Any], experts: int, top_k_key: str, norm: Any, scale: Any, where: str) -> RouterSpec:
    scoring = _get(cfg, "scoring_func")
    if scoring not in SCORING_FUNCS:
        raise InputError(f"{where}: 'scoring_func' must be one of {SCORING_FUNCS} (got {scoring!r})")
    top_k = _int(cfg, top_k_key, where)
    if top_k > experts:
        raise InputError(f"{where}: '{top_k_key}' {top_k} exceeds the {experts} experts")
    return RouterSpec(experts, top_k, scoring, bool(norm), float(scale))


def _layers(cfg: dict[str, Any], n: int, num_experts: int, mova_experts: int, where: str) -> tuple[LayerSpec, ...]:
    """The sparse-layer rule of the reference (K2HorizonConfig.is_sparse_layer)."""
    mlp_only = _get(cfg, "mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) for i in mlp_only):
        raise InputError(f"{where}: 'mlp_only_layers' must be a list of layer indices")
    step = _int(cfg, "decoder_sparse_step", where)
    layers = []
    for i in range(n):
        sparse = i not in mlp_only and num_experts > 0 and (i + 1) % step == 0
        layers.append(LayerSpec(i, sparse, sparse and mova_experts > 0))
    return tuple(layers)


def parse_args(cfg: dict[str, Any], where: str) -> K2HorizonArgs:
    n = _int(cfg, "num_hidden_layers", where)
    hidden = _int(cfg, "hidden_size", where)
    heads = _int(cfg, "num_attention_heads", where)
    kv_heads = _int(cfg, "num_key_value_heads", where)
    head_dim = _int(cfg, "head_dim", where)
    groups = _int(cfg, "layernorm_num_groups", where)
    if hidden % groups:
        raise InputError(f"{where}: hidden_size {hidden} is not divisible by layernorm_num_groups {groups}")
    if heads % kv_heads:
        raise InputError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if _get(cfg, "hidden_act") != "silu":
        raise InputError(f"{where}: hidden_act {cfg.get('hidden_act')!r} is not supported (K2-Horizon uses 'silu')")
    rope = cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": 10_000_000.0}
    if not isinstance(rope, dict) or "rope_theta" not in rope:
        raise InputError(f"{where}: 'rope_parameters' needs 'rope_theta'")
    if rope.get("rope_type", "default") != "default":
        raise InputError(f"{where}: rope_type {rope.get('rope_type')!r} is not supported (supported: default)")
    num_experts = _int(cfg, "num_experts", where, minimum=0)
    mova_experts = _int(cfg, "mova_num_experts", where, minimum=0)
    layers = _layers(cfg, n, num_experts, mova_experts, where)
    moe = mova = None
    moe_width = shared_width = 0
    if any(layer.sparse for layer in layers):
        norm, scale = _get(cfg, "norm_topk_prob"), _get(cfg, "router_scaling_factor")
        moe = _router(cfg, num_experts, "num_experts_per_tok", norm, scale, where)
        moe_width = _int(cfg, "moe_intermediate_size", where)
        shared_width = _int(cfg, "num_shared_experts", where, minimum=0) * moe_width
        if mova_experts:
            # null = the MoE router's value (schema rule)
            mova_norm = cfg.get("mova_norm_topk_prob")
            mova_scale = cfg.get("mova_router_scaling_factor")
            mova = _router(cfg, mova_experts, "mova_top_k", norm if mova_norm is None else mova_norm,
                           scale if mova_scale is None else mova_scale, where)
    dense_width = _int(cfg, "intermediate_size", where) if not all(layer.sparse for layer in layers) else 0
    return K2HorizonArgs(
        vocab_size=_int(cfg, "vocab_size", where), hidden_size=hidden, intermediate_size=dense_width,
        num_heads=heads, kv_heads=kv_heads, head_dim=head_dim, eps=float(_get(cfg, "rms_norm_eps")),
        norm_groups=groups, qk_norm=bool(_get(cfg, "query_key_norm")), attention_bias=bool(_get(cfg, "attention_bias")),
        rope_theta=float(rope["rope_theta"]), max_position_embeddings=_int(cfg, "max_position_embeddings", where),
        tie_embeddings=bool(_get(cfg, "tie_word_embeddings")), layers=layers, moe=moe, moe_width=moe_width,
        shared_width=shared_width, mova=mova,
    )
