"""Trace-friendly K2-Horizon decoder (the graph MNN runs).

Mirrors ``llmexport/reference/k2_horizon/modeling_k2_horizon.py`` with the runtime's interface:
embeddings come in as ``[seq, 1, hidden]`` (unscaled, the family has no embedding scale),
attention goes through ``FusedAttention`` (MNN's KV-cached Attention op), routed experts
through MNN's MoE op, which runs only the chosen experts' subgraphs:
- the MoE FFN's SwiGLU experts (``ExpertMlp`` template, MoE ``layer_id`` = layer index);
- MoVA's value experts (``ValueExpert`` template = SiLU(linear), MoE ``layer_id`` =
  ``num_layers`` + layer index, so both kinds share the ``/expert/{layer_id}_{e}`` namespace).
Routers are ``PlaceholderLinear``s of role ROUTER; their fp32 scoring, the selection-only bias,
normalisation and scaling are graph ops. ``dense_mova=True`` evaluates every value expert in the
main graph instead (the benchmark's baseline; same weights, same results).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmexport.models.decoder import graph as decoder_graph
from llmexport.models.decoder.graph import DecoderStack, PreNormLayer
from llmexport.models.decoder.graph import SwiGlu as Mlp
from llmexport.models.decoder.names import EXPERT_MLP, MLP
from llmexport.models.graph_parts import TensorLookup
from llmexport.models.graph_parts import const as _const
from llmexport.models.k2_horizon.args import K2HorizonArgs, LayerSpec
from llmexport.models.k2_horizon.names import SHARED_MLP
from llmexport.models.rope import RopeSpec
from llmexport.models.router import Router
from llmexport.models.tensor_names import NameTable
from llmexport.trace.ops import FusedMoE, PlaceholderLinear, dense_mixture, rms_norm

__all__ = ["K2HorizonGraph", "Mlp", "ValueExpert", "mova_layer_id"]


def mova_layer_id(args: K2HorizonArgs, index: int) -> int:
    """MoE ``layer_id`` of a layer's value experts (distinct from the FFN experts' ``index``)."""
    return args.num_layers + index


class GroupedNorm(nn.Module):
    """GroupedRMSNorm: fp32 RMS normalisation of each of ``groups`` equal slices of the last
    dimension, then the full-width weight in fp32, cast back. One group is ``ops.rms_norm``
    (the pattern MNN's converter fuses)."""

    def __init__(self, weight: torch.Tensor, groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.groups, self.eps = groups, eps

    def forward(self, x):
        if self.groups == 1:
            return rms_norm(x, self.weight, self.eps)
        shape = x.shape
        # static group width, dynamic leading dims: traces as Reshape [.., groups, width]; each
        # group's normalisation folds into one MNN LayerNorm op, the full-width weight stays a Mul
        parts = rms_norm(x.reshape(*shape[:-1], self.groups, shape[-1] // self.groups), None, self.eps)
        return (parts.reshape(shape) * self.weight).to(x.dtype)


class HeadNorm(nn.Module):
    """Per-head q/k GroupedRMSNorm (one group per head) on [1, seq, heads, head_dim]: plain
    RMSNorm over head_dim, then the full-width weight on the flattened heads. (Multiplied
    straight onto the normalised [.., heads, head_dim], MNN's converter would fold the
    [heads, head_dim] weight into the LayerNorm op as a head_dim-wide gamma: wrong for every
    head after the first.)"""

    def __init__(self, weight: torch.Tensor, heads: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.reshape(-1), requires_grad=False)
        self.heads, self.eps = heads, eps

    def forward(self, x):
        normed = rms_norm(x, None, self.eps)
        width = self.weight.numel()
        return (normed.reshape(1, -1, width) * self.weight).reshape(1, -1, self.heads, width // self.heads)


class ValueExpert(nn.Module):
    """One MoVA value expert: SiLU(linear) [n, hidden] -> [n, kv_heads * head_dim]. SiLU sits
    inside the expert so MNN's MoE op applies the routing weights after it, as the reference."""

    def __init__(self, name: str, hidden: int, width: int):
        super().__init__()
        self.proj = PlaceholderLinear(name, hidden, width)

    def forward(self, x):
        return F.silu(self.proj(x))


class Attention(decoder_graph.Attention):
    """GQA attention with per-head GroupedRMSNorm of q/k; MoVA layers take their values from
    routed value experts (v_router + v_experts) instead of v_proj. ``names``: the family's table
    bound to the layer."""

    def __init__(self, args: K2HorizonArgs, names: NameTable, layer: LayerSpec, lookup: TensorLookup,
                 dense_mova: bool):
        norms = None
        if args.qk_norm:
            norms = (HeadNorm(_const(lookup, names.name("norm.q")), args.num_heads, args.eps),
                     HeadNorm(_const(lookup, names.name("norm.k")), args.kv_heads, args.eps))
        super().__init__(names, layer.index, args.hidden_size, args.num_heads, args.kv_heads, args.head_dim,
                         args.attention_bias, norms, args=args, layer=layer, lookup=lookup, dense_mova=dense_mova)

    def init_values(self, names: NameTable, hidden: int, width: int, bias: bool, **options: Any) -> None:
        """``options``: ``args`` (K2HorizonArgs), ``layer`` (LayerSpec), ``lookup``, ``dense_mova``."""
        args: K2HorizonArgs = options["args"]
        layer: LayerSpec = options["layer"]
        lookup: TensorLookup = options["lookup"]
        dense_mova: bool = options["dense_mova"]
        self.hidden, self.mova = hidden, layer.mova
        if not layer.mova:
            super().init_values(names, hidden, width, bias)
            return
        spec = args.mova
        assert spec is not None, "a MoVA layer without MoVA settings"
        self.v_router = Router(names.name("attn.v_router"), hidden, spec, lookup(names.name("attn.v_router.bias")))
        experts = nn.ModuleList(ValueExpert(names.name("attn.v_expert", expert=e), hidden, width)
                                for e in range(spec.num_experts))
        # dense_mova: every value expert in the main graph (a ModuleList), else MNN's MoE op
        self.v_experts: nn.ModuleList | FusedMoE = experts if dense_mova else \
            FusedMoE(experts, spec.top_k, mova_layer_id(args, layer.index), width)

    def values(self, x):
        if not self.mova:
            return self.v_proj(x)
        weights, chosen = self.v_router(x)
        if isinstance(self.v_experts, nn.ModuleList):
            return dense_mixture(self.v_experts, x, weights, chosen)
        return self.v_experts(x.view(-1, self.hidden), weights, chosen)


class SparseMoe(nn.Module):
    """Router + routed SwiGLU experts on MNN's MoE op, plus the ungated shared experts.
    ``names``: the family's table bound to the layer."""

    def __init__(self, args: K2HorizonArgs, names: NameTable, index: int, lookup: TensorLookup):
        super().__init__()
        self.hidden = args.hidden_size
        assert args.moe is not None, "a sparse layer without experts"
        self.gate = Router(names.name("moe.router"), args.hidden_size, args.moe, lookup(names.name("moe.router.bias")))
        experts = nn.ModuleList(Mlp(names.names(EXPERT_MLP, expert=e), args.hidden_size, args.moe_width)
                                for e in range(args.moe.num_experts))
        self.experts = FusedMoE(experts, args.moe.top_k, index, args.hidden_size)
        self.shared_experts = Mlp(names.names(SHARED_MLP), args.hidden_size, args.shared_width) \
            if args.shared_width else None

    def forward(self, x):
        weights, chosen = self.gate(x)
        out = self.experts(x.view(-1, self.hidden), weights, chosen).view(1, -1, self.hidden)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DecoderLayer(PreNormLayer):
    def __init__(self, args: K2HorizonArgs, names: NameTable, layer: LayerSpec, lookup: TensorLookup,
                 dense_mova: bool):
        p = names.bind(layer=layer.index)
        norm = lambda key: GroupedNorm(_const(lookup, p.name(key)), args.norm_groups, args.eps)  # noqa: E731
        mlp = SparseMoe(args, p, layer.index, lookup) if layer.sparse else \
            Mlp(p.names(MLP), args.hidden_size, args.intermediate_size)
        super().__init__(norm("norm.input"), norm("norm.post_attention"),
                         Attention(args, p, layer, lookup, dense_mova), mlp)


class K2HorizonGraph(DecoderStack):
    """The pre-norm decoder stack (decoder_graph.DecoderStack) with K2-Horizon's layers and
    GroupedRMSNorm, default RoPE; the tensors named by ``names`` (k2_horizon_names.K2_HORIZON_NAMES)."""

    def __init__(self, args: K2HorizonArgs, names: NameTable, lookup: TensorLookup, dense_mova: bool = False):
        layers = [DecoderLayer(args, names, layer, lookup, dense_mova) for layer in args.layers]
        norm = GroupedNorm(_const(lookup, names.name("norm.final")), args.norm_groups, args.eps)
        rope = RopeSpec(args.rope_theta, args.head_dim, args.head_dim // 2)
        super().__init__(layers, norm, names.name("lm_head"), args.hidden_size, args.vocab_size, rope.inv_freq())
        self.args = args
