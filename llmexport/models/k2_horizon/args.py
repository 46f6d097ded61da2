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
from llmexport.models.config_values import FP32_MAX, flag_value, float_value, int_value, str_value
from llmexport.models.router import RouterSpec
from llmexport.models.shape import UniformAttentionShape
from llmexport.reference.k2_horizon.configuration_k2_horizon import K2HorizonConfig

# A key missing from config.json takes the reference configuration's default, exactly as the
# remote code the checkpoint ships would (transformers may leave default values out).
_DEFAULTS = {name: p.default for name, p in inspect.signature(K2HorizonConfig.__init__).parameters.items()
             if p.default is not inspect.Parameter.empty}

SCORING_FUNCS = ("sigmoid", "softmax")
DEFAULT_ROPE_THETA = 10_000_000.0  # K2HorizonConfig: rope_parameters defaults to {"default", 1e7}


@dataclass(frozen=True)
class LayerSpec:
    index: int
    sparse: bool  # MoE FFN instead of the dense SwiGLU MLP
    mova: bool  # values from v_router + v_experts instead of v_proj (sparse layers only)


@dataclass(frozen=True)
class K2HorizonArgs(UniformAttentionShape):
    norm_groups: int
    qk_norm: bool
    attention_bias: bool
    rope_theta: float
    layers: tuple[LayerSpec, ...]
    moe: RouterSpec | None
    moe_width: int  # routed expert intermediate size
    shared_width: int  # num_shared_experts * moe_intermediate_size (0: no shared experts)
    mova: RouterSpec | None


def _get(cfg: dict[str, Any], key: str) -> Any:
    value = cfg.get(key)
    return _DEFAULTS.get(key) if value is None else value


def _defaults(cfg: dict[str, Any], *keys: str) -> dict[str, Any]:
    """``keys`` of ``cfg`` with the reference's defaults filled in (see ``_get``)."""
    return {key: _get(cfg, key) for key in keys}


def _int(cfg: dict[str, Any], key: str, where: str, default: int | None = None, minimum: int = 1,
         maximum: int | None = None) -> int:
    return int_value(_defaults(cfg, key), key, where, default, minimum, maximum)


def _float(cfg: dict[str, Any], key: str, where: str, high: float = FP32_MAX) -> float:
    value = float_value(_defaults(cfg, key), key, where, None, high=high)
    if value is None:
        raise InputError(f"{where}: '{key}' is missing (expected a number)")
    return value


def _flag(cfg: dict[str, Any], key: str, where: str) -> bool:
    return flag_value(_defaults(cfg, key), key, where, False)


def _router(cfg: dict[str, Any], experts: int, top_k_key: str, norm_key: str, scale_key: str,
            where: str) -> RouterSpec:
    """A router's settings; ``norm_key``/``scale_key`` are read from ``cfg`` as given."""
    scoring = str_value(_defaults(cfg, "scoring_func"), "scoring_func", where, "", SCORING_FUNCS)
    top_k = _int(cfg, top_k_key, where)
    if top_k > experts:
        raise InputError(f"{where}: '{top_k_key}' {top_k} exceeds the {experts} experts")
    return RouterSpec(experts, top_k, scoring, _flag(cfg, norm_key, where), _float(cfg, scale_key, where))


def _layers(cfg: dict[str, Any], n: int, num_experts: int, mova_experts: int, where: str) -> tuple[LayerSpec, ...]:
    """The sparse-layer rule of the reference (K2HorizonConfig.is_sparse_layer)."""
    mlp_only = _get(cfg, "mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in mlp_only):
        raise InputError(f"{where}: 'mlp_only_layers' must be a list of layer indices")
    mlp_only = set(mlp_only)
    step = _int(cfg, "decoder_sparse_step", where)
    layers = []
    for i in range(n):
        sparse = i not in mlp_only and num_experts > 0 and (i + 1) % step == 0
        layers.append(LayerSpec(i, sparse, sparse and mova_experts > 0))
    return tuple(layers)


def _rope_blocks(cfg: dict[str, Any], where: str) -> dict[str, dict[str, Any]]:
    """``rope_parameters`` and the legacy ``rope_scaling`` (transformers 5 reads the latter as the
    former) when present; only the rotate-half ``default`` type exists in this family."""
    blocks = {}
    for key in ("rope_parameters", "rope_scaling"):
        block = cfg.get(key)
        if block is None:
            continue
        if not isinstance(block, dict):
            raise InputError(f"{where}: '{key}' must be an object with 'rope_type' and 'rope_theta'")
        rope_type = block.get("rope_type", block.get("type", "default"))
        if rope_type != "default":
            raise InputError(f"{where}: '{key}' rope_type {rope_type!r} is not supported (supported: default)")
        blocks[key] = block
    return blocks


def _rope_theta(cfg: dict[str, Any], where: str) -> float:
    """The RoPE base, from every key that states one; conflicting statements are refused.

    The family's modeling code reads ``rope_parameters["rope_theta"]`` (default 1e7). Under
    transformers 5 a remote-code config fills a missing ``rope_parameters.rope_theta`` from the
    top-level ``rope_theta`` and takes ``rope_scaling`` as ``rope_parameters``, but keeps the
    config's default when only a top-level ``rope_theta`` is given, while transformers 4-style
    code (and mlx-lm) reads that top-level key. A checkpoint whose keys say different things
    would run with a base that depends on which code loads it: refuse it."""
    stated = {}
    if cfg.get("rope_theta") is not None:
        stated["rope_theta"] = cfg["rope_theta"]
    blocks = _rope_blocks(cfg, where)
    for key, block in blocks.items():
        if block.get("rope_theta") is not None:
            stated[f"{key}.rope_theta"] = block["rope_theta"]
    stated = {key: float_value(stated, key, where, None) for key in stated}
    if len(set(stated.values())) > 1:
        said = ", ".join(f"'{k}' = {v}" for k, v in stated.items())
        raise InputError(f"{where}: the RoPE base is stated differently ({said}); make them equal")
    unstated = [key for key, block in blocks.items() if block.get("rope_theta") is None]
    if unstated and (len(blocks) > 1 or not stated):
        # transformers 5 would fill it from the top-level key or its own 1e4, not the family's 1e7
        raise InputError(f"{where}: '{unstated[0]}' needs 'rope_theta'")
    if not blocks and stated and float(stated["rope_theta"]) != DEFAULT_ROPE_THETA:
        raise InputError(f"{where}: 'rope_theta' = {stated['rope_theta']} but 'rope_parameters' states no "
                         f"'rope_theta': K2-Horizon's modeling code would use its default {DEFAULT_ROPE_THETA:g}; "
                         "state the base in 'rope_parameters' too")
    return next(iter(stated.values())) if stated else DEFAULT_ROPE_THETA


def parse_args(cfg: dict[str, Any], where: str, max_count: int | None = None) -> K2HorizonArgs:
    """The family's arguments; ``max_count`` bounds layer and expert counts before anything is
    sized by them (a checkpoint cannot have more of them than it has tensors)."""
    n = _int(cfg, "num_hidden_layers", where, maximum=max_count)
    hidden = _int(cfg, "hidden_size", where)
    heads = _int(cfg, "num_attention_heads", where)
    kv_heads = _int(cfg, "num_key_value_heads", where)
    head_dim = _int(cfg, "head_dim", where)
    groups = _int(cfg, "layernorm_num_groups", where)
    if hidden % groups:
        raise InputError(f"{where}: hidden_size {hidden} is not divisible by layernorm_num_groups {groups}")
    if heads % kv_heads:
        raise InputError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    str_value(_defaults(cfg, "hidden_act"), "hidden_act", where, "silu", ("silu",))
    rope_theta = _rope_theta(cfg, where)
    num_experts = _int(cfg, "num_experts", where, minimum=0, maximum=max_count)
    mova_experts = _int(cfg, "mova_num_experts", where, minimum=0, maximum=max_count)
    layers = _layers(cfg, n, num_experts, mova_experts, where)
    moe = mova = None
    moe_width = shared_width = 0
    if any(layer.sparse for layer in layers):
        moe = _router(cfg, num_experts, "num_experts_per_tok", "norm_topk_prob", "router_scaling_factor", where)
        moe_width = _int(cfg, "moe_intermediate_size", where)
        shared_width = _int(cfg, "num_shared_experts", where, minimum=0) * moe_width
        if mova_experts:
            # null = the MoE router's value (schema rule)
            mova_cfg = dict(cfg)
            for key, moe_key in (("mova_norm_topk_prob", "norm_topk_prob"),
                                 ("mova_router_scaling_factor", "router_scaling_factor")):
                if cfg.get(key) is None:
                    mova_cfg[key] = _get(cfg, moe_key)
            mova = _router(mova_cfg, mova_experts, "mova_top_k", "mova_norm_topk_prob", "mova_router_scaling_factor",
                           where)
    dense_width = _int(cfg, "intermediate_size", where) if not all(layer.sparse for layer in layers) else 0
    return K2HorizonArgs(
        vocab_size=_int(cfg, "vocab_size", where), hidden_size=hidden, intermediate_size=dense_width,
        num_heads=heads, kv_heads=kv_heads, head_dim=head_dim, eps=_float(cfg, "rms_norm_eps", where, high=1.0),
        norm_groups=groups, qk_norm=_flag(cfg, "query_key_norm", where),
        attention_bias=_flag(cfg, "attention_bias", where),
        rope_theta=rope_theta, max_position_embeddings=_int(cfg, "max_position_embeddings", where),
        tie_embeddings=_flag(cfg, "tie_word_embeddings", where), layers=layers, moe=moe, moe_width=moe_width,
        shared_width=shared_width, mova=mova,
    )
