"""LFM2 / LFM2-MoE: typed arguments read from config.json through transformers' config classes.

config.json first goes through ``Lfm2Config`` / ``Lfm2MoeConfig`` (decoder/args.py
``resolve_config``): ``layer_types`` from ``full_attn_idxs`` when absent (Lfm2Config only; the MoE
config has no such default, so its ``layer_types`` is required), ``block_ff_dim`` and
``tie_embedding`` read as ``intermediate_size`` and ``tie_word_embeddings``. The dense MLP's
width is Lfm2MLP's (transformers models/lfm2/modeling_lfm2.py): with ``block_auto_adjust_ff_dim``
``int(2 * intermediate_size / 3)``, times ``block_ffn_dim_multiplier`` rounded up to
``block_multiple_of``; LFM2-MoE's dense layers take ``intermediate_size`` as it is
(Lfm2MoeMLP). Refused by key: ``conv_bias`` (MNN's LinearAttention op has no conv bias, and
in_proj/out_proj would carry biases too), a conv kernel below 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmexport.errors import InputError
from llmexport.models.config_values import flag_value, float_value, int_value
from llmexport.models.decoder.args import FULL_ATTENTION, attention_shape, resolve_config, rope_spec
from llmexport.models.rope import RopeSpec
from llmexport.models.router import RouterSpec
from llmexport.models.shape import UniformAttentionShape

CONV = "conv"
#: Lfm2MoeTopKRouter: ``routing_weights / (sum + 1e-6)`` when norm_topk_prob
NORMALIZE_EPS = 1e-6


@dataclass(frozen=True)
class LayerSpec:
    index: int
    attention: bool  # GQA attention; otherwise the gated short conv (MNN's LinearAttention op)
    sparse: bool  # routed experts instead of the dense SwiGLU MLP (LFM2-MoE after num_dense_layers)


@dataclass(frozen=True)
class Lfm2Args(UniformAttentionShape):
    rope: RopeSpec
    conv_kernel: int  # conv_L_cache
    layers: tuple[LayerSpec, ...]
    moe: RouterSpec | None
    moe_width: int  # routed expert intermediate size (0 without experts)
    expert_bias: bool  # use_expert_bias: a selection-only bias ``feed_forward.expert_bias``


def _dense_width(cfg: dict[str, Any], where: str, adjust: bool) -> int:
    width = int_value(cfg, "intermediate_size", where)
    if not adjust or not flag_value(cfg, "block_auto_adjust_ff_dim", where, True):
        return width
    width = int(2 * width / 3)
    multiplier = float_value(cfg, "block_ffn_dim_multiplier", where, None)
    if multiplier is not None:
        multiple = int_value(cfg, "block_multiple_of", where)
        width = multiple * ((int(multiplier * width) + multiple - 1) // multiple)
    if width < 1:
        raise InputError(f"{where}: 'intermediate_size' {cfg['intermediate_size']} leaves an empty MLP")
    return width


def _layer_kinds(cfg: dict[str, Any], n: int, where: str) -> tuple[bool, ...]:
    types = cfg.get("layer_types")
    if not isinstance(types, list) or len(types) != n or set(types) - {FULL_ATTENTION, CONV}:
        raise InputError(f"{where}: 'layer_types' must list {FULL_ATTENTION!r} or {CONV!r} for each of the "
                         f"{n} layers (got {types!r})")
    return tuple(kind == FULL_ATTENTION for kind in types)


def _router(cfg: dict[str, Any], experts: int, where: str) -> RouterSpec:
    top_k = int_value(cfg, "num_experts_per_tok", where)
    if top_k > experts:
        raise InputError(f"{where}: 'num_experts_per_tok' {top_k} exceeds the {experts} experts")
    scale = float_value(cfg, "routed_scaling_factor", where, 1.0)
    return RouterSpec(experts, top_k, "sigmoid", flag_value(cfg, "norm_topk_prob", where, True), scale)


def parse_args(config_class: Any, raw: dict[str, Any], where: str, moe: bool,
               max_count: int | None = None) -> Lfm2Args:
    """The family's arguments from config.json ``raw`` (``moe``: LFM2-MoE's keys); ``max_count``
    bounds layer and expert counts before anything is sized by them."""
    cfg = resolve_config(config_class, raw, where)
    if flag_value(cfg, "conv_bias", where, False):
        raise InputError(f"{where}: 'conv_bias' true is not supported (MNN's LinearAttention op has no conv bias)")
    n = int_value(cfg, "num_hidden_layers", where, maximum=max_count)
    hidden, heads, kv_heads, head_dim = attention_shape(cfg, where)  # Lfm2Attention: getattr(config, "head_dim", ...)
    attention = _layer_kinds(cfg, n, where)
    dense_layers = int_value(cfg, "num_dense_layers", where, minimum=0) if moe else n
    router, moe_width, expert_bias = None, 0, False
    if moe and dense_layers < n:
        router = _router(cfg, int_value(cfg, "num_experts", where, maximum=max_count), where)
        moe_width = int_value(cfg, "moe_intermediate_size", where)
        expert_bias = flag_value(cfg, "use_expert_bias", where, True)
    layers = tuple(LayerSpec(i, attention[i], router is not None and i >= dense_layers) for i in range(n))
    return Lfm2Args(
        vocab_size=int_value(cfg, "vocab_size", where), hidden_size=hidden,
        intermediate_size=_dense_width(cfg, where, not moe) if dense_layers else 0,
        num_heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        eps=float_value(cfg, "norm_eps", where, None, high=1.0) or _missing(where, "norm_eps"),
        rope=rope_spec(cfg, head_dim, where, ("default",)),
        conv_kernel=int_value(cfg, "conv_L_cache", where, minimum=2),
        tie_embeddings=flag_value(cfg, "tie_word_embeddings", where, True),
        max_position_embeddings=int_value(cfg, "max_position_embeddings", where),
        layers=layers, moe=router, moe_width=moe_width, expert_bias=expert_bias,
    )


def _missing(where: str, key: str):
    raise InputError(f"{where}: '{key}' is missing (expected a number)")
