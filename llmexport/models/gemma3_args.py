"""Gemma3 text decoder (``gemma3_text``): typed arguments from config.json.

config.json goes through transformers' ``Gemma3TextConfig`` first (as the HF reference reads it):
absent ``layer_types`` become five sliding layers to one full, transformers 4's ``rope_theta``,
``rope_local_base_freq`` and ``rope_scaling`` become ``rope_parameters`` per layer type. Features
the graph does not implement are refused by key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmexport.errors import InputError
from llmexport.models.config_values import flag_value, float_value, int_value
from llmexport.models.decoder.args import resolve_config
from llmexport.models.layer_types import SLIDING, read_layer_types, rope_specs
from llmexport.models.rope import RopeSpec
from llmexport.models.shape import UniformAttentionShape


@dataclass(frozen=True)
class LayerSpec:
    index: int
    kind: str  # layer_types.SLIDING or FULL
    head_dim: int


@dataclass(frozen=True)
class Gemma3Args(UniformAttentionShape):
    scale: float  # the attention scale, query_pre_attn_scalar ** -0.5
    attention_bias: bool
    sliding_window: int
    layers: tuple[LayerSpec, ...]
    rope: dict[str, RopeSpec]
    final_softcap: float | None

    @property
    def mixed(self) -> bool:
        return len(self.rope) > 1


def parse_gemma3_args(raw: dict[str, Any], where: str, max_layers: int | None = None) -> Gemma3Args:
    from transformers import Gemma3TextConfig

    cfg = resolve_config(Gemma3TextConfig, raw, where)
    for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if cfg.get(key):
            raise InputError(f"{where}: {key}={cfg[key]!r} is not supported")
    activation = cfg.get("hidden_activation")
    if activation != "gelu_pytorch_tanh":
        raise InputError(f"{where}: hidden_activation {activation!r} is not supported (gelu_pytorch_tanh)")
    n = int_value(cfg, "num_hidden_layers", where, maximum=max_layers)
    heads, kv_heads, head_dim = (int_value(cfg, k, where) for k in
                                 ("num_attention_heads", "num_key_value_heads", "head_dim"))
    if head_dim % 2 or heads % kv_heads:
        raise InputError(f"{where}: head_dim {head_dim} must be even and num_attention_heads {heads} a multiple "
                         f"of num_key_value_heads {kv_heads}")
    kinds = read_layer_types(cfg, n, where)
    layers = tuple(LayerSpec(i, kind, head_dim) for i, kind in enumerate(kinds))
    window = int_value(cfg, "sliding_window", where, 0, 0)
    if SLIDING in kinds and not window:
        raise InputError(f"{where}: sliding layers need a 'sliding_window' >= 1")
    for kind, params in (cfg.get("rope_parameters") or {}).items():
        if isinstance(params, dict) and float_value(params, "partial_rotary_factor", where, 1.0) != 1.0:
            raise InputError(f"{where}: rope_parameters[{kind!r}]: partial_rotary_factor is not supported (1.0)")
    return Gemma3Args(
        vocab_size=int_value(cfg, "vocab_size", where), hidden_size=int_value(cfg, "hidden_size", where),
        intermediate_size=int_value(cfg, "intermediate_size", where), num_heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, eps=float_value(cfg, "rms_norm_eps", where, 1e-6, high=1.0),
        scale=float_value(cfg, "query_pre_attn_scalar", where, 256.0) ** -0.5,
        attention_bias=flag_value(cfg, "attention_bias", where, False), sliding_window=window, layers=layers,
        rope=rope_specs(cfg, layers, where, ("default", "linear")),
        final_softcap=float_value(cfg, "final_logit_softcapping", where, None),
        tie_embeddings=flag_value(cfg, "tie_word_embeddings", where, True),
        max_position_embeddings=int_value(cfg, "max_position_embeddings", where, 131072),
    )
