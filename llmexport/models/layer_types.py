"""Decoders with two kinds of attention layers (``layer_types``: sliding and full), each kind with
its own RoPE table: Gemma3 and Gemma4.

What they share: reading ``layer_types`` and the per-type ``rope_parameters``, the runtime's
"mix" inputs (``attention_mask`` [2, 1, 1, seq, kv]: slice 0 full, slice 1 sliding, read by the
runtime from ``sliding_window`` in llm_config.json) and the graph's per-type RoPE tables and mask
slices. Without sliding layers the mask is the plain [1, 1, seq, kv].
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol

import torch
from torch import nn

from llmexport.errors import InputError
from llmexport.models.config_values import float_value
from llmexport.models.rope import RopeSpec, rope_cos_sin
from llmexport.spec import GraphInputs

SLIDING, FULL = "sliding_attention", "full_attention"


class TypedLayer(Protocol):
    @property
    def kind(self) -> str: ...  # SLIDING or FULL

    @property
    def head_dim(self) -> int: ...


def read_layer_types(cfg: dict[str, Any], n: int, where: str) -> list[str]:
    layer_types = cfg.get("layer_types")
    if not isinstance(layer_types, list) or len(layer_types) != n or \
            not all(isinstance(t, str) and t in (SLIDING, FULL) for t in layer_types):
        raise InputError(f"{where}: 'layer_types' must list {n} of {SLIDING!r}/{FULL!r}")
    return list(layer_types)


def rope_specs(cfg: dict[str, Any], layers: Iterable[TypedLayer], where: str,
               types: tuple[str, ...]) -> dict[str, RopeSpec]:
    """One RoPE table per layer type from ``rope_parameters[type]`` (transformers 5's layout).
    ``types``: the accepted rope types, of "default" (every pair rotated, ``factor`` ignored as HF's
    default RoPE does), "linear" (frequencies divided by ``factor``) and "proportional" (Gemma4:
    the first ``partial_rotary_factor`` of the pairs rotated, divided by ``factor``)."""
    layers = list(layers)
    params = cfg.get("rope_parameters")
    if not isinstance(params, dict):
        raise InputError(f"{where}: 'rope_parameters' must map layer types to RoPE settings")
    specs = {}
    for kind in sorted({layer.kind for layer in layers}):  # sorted: trace order must be deterministic
        p = params.get(kind)
        label = f"{where}: rope_parameters[{kind!r}]"
        if not isinstance(p, dict):
            raise InputError(f"{label} must be an object with 'rope_theta'")
        head_dims = {layer.head_dim for layer in layers if layer.kind == kind}
        if len(head_dims) != 1:
            raise InputError(f"{where}: {kind} layers disagree on head_dim {sorted(head_dims)}")
        head_dim = head_dims.pop()
        rope_type = p.get("rope_type", "default")
        fraction = float_value(p, "partial_rotary_factor", label, 1.0)
        if rope_type not in types or fraction > 1.0 or (rope_type != "proportional" and fraction != 1.0
                                                        and "proportional" not in types):
            raise InputError(f"{label}: rope_type {rope_type!r} with partial_rotary_factor {fraction} is not "
                             f"supported ({', '.join(types)}; a factor < 1 only with proportional)")
        pairs = int(fraction * head_dim // 2) if rope_type == "proportional" else head_dim // 2
        theta = float_value(p, "rope_theta", label, None)
        if theta is None:
            raise InputError(f"{label}: 'rope_theta' is missing")
        factor = float_value(p, "factor", label, 1.0) if rope_type != "default" else 1.0
        specs[kind] = RopeSpec(theta, head_dim, pairs, factor)
    return specs


def mixed_graph_inputs(seq_len: int, width: int, mixed: bool) -> GraphInputs:
    """The runtime's inputs: token-table rows [seq, 1, width], the attention mask (two slices
    when ``mixed``), positions, logits index."""
    mask_shape = [2, 1, 1, seq_len, seq_len] if mixed else [1, 1, seq_len, seq_len]
    args = [torch.randn(seq_len, 1, width), torch.zeros(mask_shape),
            torch.arange(seq_len, dtype=torch.int32).view(1, -1), torch.tensor([-1], dtype=torch.int32)]
    names = ["input_ids", "attention_mask", "position_ids", "logits_index"]
    axes = {"input_ids": {0: "seq_len"}, "attention_mask": {len(mask_shape) - 2: "seq_len",
                                                            len(mask_shape) - 1: "kv_len"},
            "position_ids": {1: "seq_len"}}
    return GraphInputs(tuple(args), names, axes, ["logits", "hidden_states"])


def register_ropes(module: nn.Module, rope: dict[str, RopeSpec]) -> None:
    """The inverse frequencies of each layer type, as buffers ``inv_freq_<type>`` of ``module``."""
    for kind, spec in rope.items():
        module.register_buffer(f"inv_freq_{kind}", spec.inv_freq(), persistent=False)


def layer_ropes(module: nn.Module, position_ids: torch.Tensor,
                kinds: Iterable[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """cos and sin per layer type from the buffers ``register_ropes`` made."""
    return {kind: rope_cos_sin(position_ids, getattr(module, f"inv_freq_{kind}")) for kind in kinds}


def layer_masks(attention_mask: torch.Tensor, mixed: bool) -> dict[str, torch.Tensor] | None:
    """The mask slice of each layer type (None: one mask for every layer)."""
    # unbind (one Split op) rather than indexing: traced, each index costs a Gather and ~10 shape ops
    return dict(zip((FULL, SLIDING), attention_mask.unbind(0))) if mixed else None


def mix_config(rope: dict[str, RopeSpec], sliding_window: int) -> dict[str, Any]:
    """llm_config.json's attention keys: "mix" and the window where there are sliding layers."""
    mixed = len(rope) > 1
    config: dict[str, Any] = {"attention_type": "mix" if mixed else "full"}
    if mixed and sliding_window:
        config["sliding_window"] = sliding_window
    return config
