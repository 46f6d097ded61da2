"""Qwen3.5: typed arguments of the text model, read through transformers' config classes.

The multimodal types (``qwen3_5``, ``qwen3_5_moe``) keep the text model's config under
``text_config`` (Qwen3_5Config / Qwen3_5MoeConfig); the text types (``qwen3_5_text``,
``qwen3_5_moe_text``) are that config itself. Either goes through the text config class
(``Qwen3_5TextConfig`` / ``Qwen3_5MoeTextConfig``, ``from_dict``) first, so absent keys take
transformers' defaults and ``layer_types`` is derived from ``full_attention_interval`` as the
reference derives it. Refused by key: attention biases, an ungated attention
(``attn_output_gate`` false), RoPE types other than the default, an activation other than SiLU.
M-RoPE's ``mrope_section`` (default [11, 11, 10], Qwen3_5TextRotaryEmbedding) only matters when
the three position rows differ (images, video): text prompts give equal rows, and the rotation is
1-D RoPE over the first ``head_dim * partial_rotary_factor`` dims; an export with the vision tower
takes the three rows (qwen_vl/mrope.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmexport.errors import InputError
from llmexport.models.config_values import flag_value, float_value, int_value, str_value
from llmexport.models.decoder.args import resolve_config
from llmexport.models.qwen_vl.mrope import mrope_section
from llmexport.models.shape import UniformAttentionShape

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class DeltaNetSpec:
    """A Gated DeltaNet layer's shape (Qwen3_5GatedDeltaNet)."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    kernel: int  # the causal depthwise conv's width

    @property
    def key_width(self) -> int:
        return self.k_heads * self.k_dim

    @property
    def value_width(self) -> int:
        return self.v_heads * self.v_dim

    @property
    def channels(self) -> int:
        """in_proj_qkv's width, the conv's channels: q, k, v."""
        return 2 * self.key_width + self.value_width


@dataclass(frozen=True)
class MoeSpec:
    """The sparse block (Qwen3_5MoeSparseMoeBlock): softmax top-k always renormalised, plus the
    shared expert gated by sigmoid(shared_expert_gate(x))."""

    num_experts: int
    top_k: int
    width: int
    shared_width: int


@dataclass(frozen=True)
class LayerSpec:
    index: int
    linear: bool  # Gated DeltaNet token mixer instead of gated full attention


@dataclass(frozen=True)
class Qwen3_5Args(UniformAttentionShape):
    rope_theta: float
    rotary_dim: int  # the rotated prefix of each head (head_dim * partial_rotary_factor, even)
    mrope_section: tuple[int, int, int]  # rotary pairs per position row (t, h, w), interleaved
    delta: DeltaNetSpec
    moe: MoeSpec | None


def text_config(raw: dict[str, Any], multimodal: bool, where: str) -> dict[str, Any]:
    """The text model's config as given (``text_config`` of a multimodal checkpoint)."""
    if not multimodal:
        return raw
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise InputError(f"{where}: 'text_config' must be an object (the text model's config)")
    return text


def _rope(cfg: dict[str, Any], head_dim: int, where: str) -> tuple[float, int, tuple[int, int, int]]:
    params = cfg.get("rope_parameters")
    if not isinstance(params, dict):
        raise InputError(f"{where}: 'rope_parameters' must be an object with 'rope_theta'")
    label = f"{where}: rope_parameters"
    str_value(params, "rope_type", label, "default", ("default",))
    theta = float_value(params, "rope_theta", label, None)
    if theta is None:
        raise InputError(f"{label}: 'rope_theta' is missing")
    factor = float_value(params, "partial_rotary_factor", label, 1.0, high=1.0)
    rotary = int(head_dim * factor)  # HF: int(head_dim * partial_rotary_factor)
    if rotary < 2 or rotary % 2:
        raise InputError(f"{label}: partial_rotary_factor {factor} leaves {rotary} rotated dims of head_dim "
                         f"{head_dim} (an even number >= 2 is needed)")
    return theta, rotary, mrope_section(params, label, [11, 11, 10])  # Qwen3_5TextRotaryEmbedding's default


def _layers(cfg: dict[str, Any], n: int, where: str) -> tuple[LayerSpec, ...]:
    kinds = cfg.get("layer_types")
    if not isinstance(kinds, list) or len(kinds) != n or set(kinds) - {LINEAR, FULL}:
        raise InputError(f"{where}: 'layer_types' must list {LINEAR!r} or {FULL!r} for each of the {n} layers "
                         f"(got {kinds!r})")
    return tuple(LayerSpec(i, kind == LINEAR) for i, kind in enumerate(kinds))


def _delta(cfg: dict[str, Any], where: str) -> DeltaNetSpec:
    spec = DeltaNetSpec(*(int_value(cfg, key, where) for key in (
        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
        "linear_conv_kernel_dim")))
    if spec.v_heads % spec.k_heads:
        raise InputError(f"{where}: linear_num_value_heads {spec.v_heads} is not a multiple of "
                         f"linear_num_key_heads {spec.k_heads}")
    return spec


def _moe(cfg: dict[str, Any], where: str, max_count: int | None) -> MoeSpec:
    experts = int_value(cfg, "num_experts", where, maximum=max_count)
    moe = MoeSpec(experts, int_value(cfg, "num_experts_per_tok", where), int_value(cfg, "moe_intermediate_size", where),
                  int_value(cfg, "shared_expert_intermediate_size", where))
    if moe.top_k > experts:
        raise InputError(f"{where}: 'num_experts_per_tok' {moe.top_k} exceeds the {experts} experts")
    return moe


def parse_args(raw: dict[str, Any], config_class: Any, where: str, *, multimodal: bool, moe: bool,
               max_count: int | None = None) -> Qwen3_5Args:
    """The text model's arguments from config.json (``raw``), resolved by ``config_class`` (the
    text config class); ``max_count`` bounds layer, head and expert counts by the tensors present."""
    label = f"{where}: text_config" if multimodal else where
    cfg = resolve_config(config_class, text_config(raw, multimodal, where), label)
    str_value(cfg, "hidden_act", label, "silu", ("silu",))
    if flag_value(cfg, "attention_bias", label, False):
        raise InputError(f"{label}: 'attention_bias' true is not supported")
    if not flag_value(cfg, "attn_output_gate", label, True):
        # Qwen3_5Attention always gates (q_proj carries the gate): a checkpoint without it is another model
        raise InputError(f"{label}: 'attn_output_gate' false is not supported (the gated attention of Qwen3.5)")
    n = int_value(cfg, "num_hidden_layers", label, maximum=max_count)
    hidden, heads = int_value(cfg, "hidden_size", label), int_value(cfg, "num_attention_heads", label)
    kv_heads = int_value(cfg, "num_key_value_heads", label, heads)
    if heads % kv_heads:
        raise InputError(f"{label}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    head_dim = int_value(cfg, "head_dim", label)
    theta, rotary, section = _rope(cfg, head_dim, label)
    # a multimodal checkpoint's head is tied by the outer config (Qwen3_5Config.tie_word_embeddings)
    tie = flag_value(raw if multimodal else cfg, "tie_word_embeddings", where, False)
    return Qwen3_5Args(
        vocab_size=int_value(cfg, "vocab_size", label), hidden_size=hidden,
        intermediate_size=0 if moe else int_value(cfg, "intermediate_size", label),
        num_heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        eps=float_value(cfg, "rms_norm_eps", label, None, high=1.0) or _missing(label, "rms_norm_eps"),
        tie_embeddings=tie, max_position_embeddings=int_value(cfg, "max_position_embeddings", label),
        layers=_layers(cfg, n, label), rope_theta=theta, rotary_dim=rotary, mrope_section=section,
        delta=_delta(cfg, label), moe=_moe(cfg, label, max_count) if moe else None)


def _missing(label: str, key: str):
    raise InputError(f"{label}: '{key}' is missing (expected a number)")
