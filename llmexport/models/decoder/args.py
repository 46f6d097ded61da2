"""Typed arguments of the plain decoder families (Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral) from config.json.

config.json first goes through the family's transformers config class, as the HF reference does
(``from_dict``): the same defaults for absent keys, transformers 4 spellings (``rope_theta`` +
``rope_scaling``) turned into ``rope_parameters``, ``num_experts`` into ``num_local_experts``.
Every value the export uses is then read with a type and range check, and features the graph
does not implement (MLP biases, other RoPE types, sliding windows in a family whose reference
has none) are refused by key.

Sliding windows (``SlidingRule``): HF's sliding layers attend to the keys ``k > q - window``
(masking_utils ``sliding_window_overlay``), which is the runtime's "mix" mask slice 1 (the
verification's eager inputs build the same, llmexport/trace/eager.py). Qwen2 marks its sliding layers
in ``layer_types`` (Qwen2Config derives them from ``use_sliding_window`` and
``max_window_layers``); Mistral's model slides every layer when ``sliding_window`` is set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmexport.errors import InputError
from llmexport.models.config_values import flag_value, float_value, int_value, str_value
from llmexport.models.rope import Llama3Scaling, RopeSpec
from llmexport.models.shape import UniformAttentionShape

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
#: the attention projections that may carry a bias (decoder_names.LLAMA_LAYOUT keys)
ATTENTION_PROJECTIONS = ("attn.q", "attn.k", "attn.v", "attn.o")
#: how a family's reference chooses sliding layers: none (sliding configs refused), by
#: ``layer_types`` (Qwen2), every layer when ``sliding_window`` is set (Mistral)
NO_SLIDING, BY_LAYER_TYPES, EVERY_LAYER = "none", "layer_types", "every_layer"


@dataclass(frozen=True)
class LayerSpec:
    index: int
    sparse: bool  # routed MoE FFN instead of the dense SwiGLU MLP
    sliding: bool = False  # attends to the last ``DecoderArgs.sliding_window`` keys (mask slice 1)
    rope: bool = True  # rotates q and k (SmolLM3's NoPE layers do not)


@dataclass(frozen=True)
class MoeSpec:
    """Routed experts (Qwen3-MoE): softmax router in fp32, top-k, optional renormalisation."""

    num_experts: int
    top_k: int
    width: int
    normalize: bool


@dataclass(frozen=True)
class DecoderArgs(UniformAttentionShape):
    rope: RopeSpec
    qk_norm: bool  # per-head RMSNorm of q and k over head_dim, before RoPE (Qwen3)
    biases: frozenset[str]  # the attention projections (ATTENTION_PROJECTIONS) with a bias
    layers: tuple[LayerSpec, ...]
    moe: MoeSpec | None
    sliding_window: int = 0  # keys a sliding layer sees (0: every layer is full attention)


def resolve_config(config_class: Any, raw: dict[str, Any], where: str) -> dict[str, Any]:
    """``raw`` as transformers reads it: ``config_class.from_dict(raw).to_dict()``."""
    from huggingface_hub.errors import StrictDataclassError

    try:
        return config_class.from_dict(dict(raw)).to_dict()
    except (StrictDataclassError, TypeError, ValueError, KeyError, AttributeError, IndexError, ArithmeticError) as exc:
        # what transformers' validators and __post_init__ raise on values of the wrong kind
        raise InputError(f"{where}: transformers' {config_class.__name__} rejects it "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None


def rope_spec(cfg: dict[str, Any], head_dim: int, where: str, types: tuple[str, ...]) -> RopeSpec:
    """RoPE from a resolved config's ``rope_parameters`` (``types``: the accepted rope_type values)."""
    params = cfg.get("rope_parameters")
    if not isinstance(params, dict):
        raise InputError(f"{where}: 'rope_parameters' must be an object with 'rope_theta'")
    label = f"{where}: rope_parameters"
    rope_type = str_value(params, "rope_type", label, "default", types)
    theta = float_value(params, "rope_theta", label, None)
    if theta is None:
        raise InputError(f"{label}: 'rope_theta' is missing")
    if float_value(params, "partial_rotary_factor", label, 1.0) != 1.0:
        raise InputError(f"{label}: partial_rotary_factor {params['partial_rotary_factor']} is not supported (1.0)")
    scaling = None
    if rope_type == "llama3":
        scaling = Llama3Scaling(
            float_value(params, "factor", label, None) or _missing(label, "factor"),
            float_value(params, "low_freq_factor", label, None) or _missing(label, "low_freq_factor"),
            float_value(params, "high_freq_factor", label, None) or _missing(label, "high_freq_factor"),
            int_value(params, "original_max_position_embeddings", label))
        if scaling.high_freq_factor <= scaling.low_freq_factor:
            raise InputError(f"{label}: high_freq_factor must exceed low_freq_factor")
    return RopeSpec(theta, head_dim, head_dim // 2, llama3=scaling)


def _missing(label: str, key: str):
    raise InputError(f"{label}: '{key}' is missing (expected a number)")


def _layers(cfg: dict[str, Any], n: int, num_experts: int, where: str) -> tuple[LayerSpec, ...]:
    """HF Qwen3MoeDecoderLayer's rule: sparse unless listed in ``mlp_only_layers``, when experts
    exist and the index falls on the ``decoder_sparse_step`` rhythm."""
    if not num_experts:
        return tuple(LayerSpec(i, False) for i in range(n))
    mlp_only = cfg.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in mlp_only):
        raise InputError(f"{where}: 'mlp_only_layers' must be a list of layer indices")
    step = int_value(cfg, "decoder_sparse_step", where, 1)
    return tuple(LayerSpec(i, i not in set(mlp_only) and (i + 1) % step == 0) for i in range(n))


def _check_unsupported(cfg: dict[str, Any], where: str, sliding: str) -> None:
    str_value(cfg, "hidden_act", where, "silu", ("silu",))
    if flag_value(cfg, "mlp_bias", where, False):
        raise InputError(f"{where}: 'mlp_bias' true is not supported")
    if sliding != NO_SLIDING:
        return
    if flag_value(cfg, "use_sliding_window", where, False):
        raise InputError(f"{where}: 'use_sliding_window' true is not supported (full attention only)")
    types = cfg.get("layer_types")
    if types is not None and (not isinstance(types, list) or set(types) - {FULL_ATTENTION}):
        raise InputError(f"{where}: 'layer_types' must all be {FULL_ATTENTION!r} (got {types!r})")


def sliding_layers(cfg: dict[str, Any], n: int, where: str, sliding: str) -> tuple[tuple[bool, ...], int]:
    """Which of the ``n`` layers slide (``sliding``: the family's rule) and the window (0: none)."""
    window = cfg.get("sliding_window")
    if sliding == NO_SLIDING:
        return (False,) * n, 0
    if sliding == EVERY_LAYER:
        flags = (window is not None,) * n
    else:
        types = cfg.get("layer_types")
        if not isinstance(types, list) or len(types) != n or set(types) - {FULL_ATTENTION, SLIDING_ATTENTION}:
            raise InputError(f"{where}: 'layer_types' must list {FULL_ATTENTION!r} or {SLIDING_ATTENTION!r} "
                             f"for each of the {n} layers (got {types!r})")
        flags = tuple(kind == SLIDING_ATTENTION for kind in types)
    if not any(flags):
        return flags, 0
    return flags, int_value(cfg, "sliding_window", where)


def _rope_layers(cfg: dict[str, Any], n: int, where: str, no_rope: bool) -> tuple[bool, ...]:
    """Which layers rotate q/k: all, or SmolLM3's ``no_rope_layers`` (1: RoPE, 0: NoPE; its config
    class derives them from ``no_rope_layer_interval``)."""
    if not no_rope:
        return (True,) * n
    flags = cfg.get("no_rope_layers")
    if not isinstance(flags, list) or len(flags) != n or any(f not in (0, 1) or isinstance(f, float) for f in flags):
        raise InputError(f"{where}: 'no_rope_layers' must list 1 (RoPE) or 0 (no RoPE) for each of the {n} layers "
                         f"(got {flags!r})")
    return tuple(bool(f) for f in flags)


def attention_biases(cfg: dict[str, Any], where: str, fixed: tuple[str, ...] | None) -> frozenset[str]:
    """The projections with a bias: the family's ``fixed`` set (Qwen2: q, k, v), or all four
    with ``attention_bias`` (Llama, Qwen3)."""
    if fixed is not None:
        return frozenset(fixed)
    return frozenset(ATTENTION_PROJECTIONS if flag_value(cfg, "attention_bias", where, False) else ())


def attention_shape(cfg: dict[str, Any], where: str) -> tuple[int, int, int, int]:
    """(hidden_size, heads, KV heads, head_dim) of GQA attention with RoPE; head_dim defaults to
    hidden / heads, as the HF attention modules take it."""
    hidden, heads = int_value(cfg, "hidden_size", where), int_value(cfg, "num_attention_heads", where)
    kv_heads = int_value(cfg, "num_key_value_heads", where, heads)
    if heads % kv_heads:
        raise InputError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if cfg.get("head_dim") is None and hidden % heads:
        raise InputError(f"{where}: 'head_dim' is missing and hidden_size {hidden} is not divisible by {heads} heads")
    head_dim = int_value(cfg, "head_dim", where, hidden // heads)
    if head_dim % 2:
        raise InputError(f"{where}: head_dim {head_dim} must be even (RoPE rotates pairs)")
    return hidden, heads, kv_heads, head_dim


def parse_decoder_args(cfg: dict[str, Any], where: str, *, qk_norm: bool, rope_types: tuple[str, ...],
                       max_count: int | None = None, sliding: str = NO_SLIDING,
                       biases: tuple[str, ...] | None = None, no_rope: bool = False) -> DecoderArgs:
    """Arguments from a resolved config (``resolve_config``); ``max_count`` bounds the layer and
    expert counts by the tensors present before anything is sized by them; ``sliding`` and
    ``biases``: the family's rule for sliding layers and its biased projections (None: by
    ``attention_bias``); ``no_rope``: layers without RoPE listed in ``no_rope_layers``."""
    _check_unsupported(cfg, where, sliding)
    n = int_value(cfg, "num_hidden_layers", where, maximum=max_count)
    hidden, heads, kv_heads, head_dim = attention_shape(cfg, where)
    num_experts = int_value(cfg, "num_local_experts", where, 0, minimum=0, maximum=max_count)
    slides, window = sliding_layers(cfg, n, where, sliding)
    layers = tuple(LayerSpec(layer.index, layer.sparse, slide, rope) for layer, slide, rope
                   in zip(_layers(cfg, n, num_experts, where), slides, _rope_layers(cfg, n, where, no_rope)))
    moe = None
    if any(layer.sparse for layer in layers):
        moe = MoeSpec(num_experts, int_value(cfg, "num_experts_per_tok", where),
                      int_value(cfg, "moe_intermediate_size", where), flag_value(cfg, "norm_topk_prob", where, False))
        if moe.top_k > num_experts:
            raise InputError(f"{where}: 'num_experts_per_tok' {moe.top_k} exceeds the {num_experts} experts")
    dense = not all(layer.sparse for layer in layers)
    return DecoderArgs(
        vocab_size=int_value(cfg, "vocab_size", where), hidden_size=hidden,
        intermediate_size=int_value(cfg, "intermediate_size", where) if dense else 0,
        num_heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        eps=float_value(cfg, "rms_norm_eps", where, None, high=1.0) or _missing(where, "rms_norm_eps"),
        rope=rope_spec(cfg, head_dim, where, rope_types), qk_norm=qk_norm,
        biases=attention_biases(cfg, where, biases),
        tie_embeddings=flag_value(cfg, "tie_word_embeddings", where, False),
        max_position_embeddings=int_value(cfg, "max_position_embeddings", where), layers=layers, moe=moe,
        sliding_window=window,
    )
