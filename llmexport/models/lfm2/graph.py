"""Trace-friendly LFM2 / LFM2-MoE decoder (the graph MNN runs).

Mirrors transformers' models/lfm2/modeling_lfm2.py and models/lfm2_moe/modeling_lfm2_moe.py with
the runtime's interface (decoder/graph.py ``DecoderStack``): each layer is
``h = x + op(operator_norm(x)); out = h + feed_forward(ffn_norm(h))`` (Lfm2DecoderLayer), where
the op is either
- GQA attention with per-head RMSNorm of q and k before RoPE (Lfm2Attention: q_layernorm,
  k_layernorm, default RoPE, 1/sqrt(head_dim)), MNN's Attention op; or
- the gated short conv (Lfm2ShortConv): in_proj -> (B, C, x) chunks over channels, ``C *
  conv(B * x)`` with a causal depthwise conv of ``conv_L_cache`` taps, no bias, no activation,
  then out_proj; the conv with its carried inputs is MNN's LinearAttention op (``short_conv``),
  which reads no mask.
The final RMSNorm is HF's ``embedding_norm`` (applied after the last layer). LFM2-MoE's sparse
layers: Lfm2MoeTopKRouter (sigmoid scores, ``expert_bias`` for selection only, renormalised with
+1e-6, ``routed_scaling_factor``) over SwiGLU experts on MNN's MoE op.
"""

from __future__ import annotations

import torch
from torch import nn

from llmexport.models.decoder import graph as decoder_graph
from llmexport.models.decoder.graph import DecoderStack, PreNormLayer, SwiGlu
from llmexport.models.decoder.names import EXPERT_MLP, MLP
from llmexport.models.graph_parts import Norm, TensorLookup, const
from llmexport.models.lfm2.args import NORMALIZE_EPS, LayerSpec, Lfm2Args
from llmexport.models.router import Router
from llmexport.models.tensor_names import NameTable
from llmexport.trace.ops import SHORT_CONV, FusedLinearAttention, FusedMoE, PlaceholderLinear


class ShortConv(nn.Module):
    """Lfm2ShortConv on [1, seq, hidden]: in_proj's channel-major output is the LinearAttention
    op's qkv [1, 3 * hidden, seq]; the op's unused gate and beta are zeros [1, seq, 1] computed
    from the input, so the sequence axis stays dynamic. ``names``: the table bound to the layer."""

    def __init__(self, names: NameTable, index: int, hidden: int, lookup: TensorLookup):
        super().__init__()
        self.hidden = hidden
        self.in_proj = PlaceholderLinear(names.name("conv.in"), hidden, 3 * hidden)
        self.out_proj = PlaceholderLinear(names.name("conv.out"), hidden, hidden)
        self.conv_weight = const(lookup, names.name("conv.weight"))  # [hidden, 1, kernel], fp32
        self.conv = FusedLinearAttention(index, SHORT_CONV, 1, 1, hidden, hidden, use_qk_l2norm=False)

    def forward(self, x, cos, sin, mask):
        bcx = self.in_proj(x).transpose(1, 2)
        unused = x[..., :1] * 0.0
        out = self.conv(bcx, unused, unused, self.conv_weight)
        return self.out_proj(out.reshape(1, -1, self.hidden))


class SparseMoe(nn.Module):
    """Lfm2MoeSparseMoeBlock: the router (selection-only ``expert_bias``) and SwiGLU experts on
    MNN's MoE op (layer_id = layer index). ``names``: the table bound to the layer."""

    def __init__(self, args: Lfm2Args, names: NameTable, index: int, lookup: TensorLookup):
        super().__init__()
        assert args.moe is not None, "a sparse layer without experts"
        self.hidden = args.hidden_size
        bias = lookup(names.name("moe.router.bias")) if args.expert_bias else torch.zeros(args.moe.num_experts)
        self.gate = Router(names.name("moe.router"), args.hidden_size, args.moe, bias, NORMALIZE_EPS)
        experts = nn.ModuleList(SwiGlu(names.names(EXPERT_MLP, expert=e), args.hidden_size, args.moe_width)
                                for e in range(args.moe.num_experts))
        self.experts = FusedMoE(experts, args.moe.top_k, index, args.hidden_size)

    def forward(self, x):
        weights, chosen = self.gate(x)
        return self.experts(x.view(-1, self.hidden), weights, chosen).view(1, -1, self.hidden)


def _layer(args: Lfm2Args, names: NameTable, layer: LayerSpec, lookup: TensorLookup) -> PreNormLayer:
    p = names.bind(layer=layer.index)
    norm = lambda key: Norm(const(lookup, p.name(key)), args.eps)  # noqa: E731
    if layer.attention:
        op: nn.Module = decoder_graph.Attention(p, layer.index, args.hidden_size, args.num_heads, args.kv_heads,
                                                args.head_dim, False, (norm("norm.q"), norm("norm.k")))
    else:
        op = ShortConv(p, layer.index, args.hidden_size, lookup)
    mlp = SparseMoe(args, p, layer.index, lookup) if layer.sparse else \
        SwiGlu(p.names(MLP), args.hidden_size, args.intermediate_size)
    return PreNormLayer(norm("norm.input"), norm("norm.post_attention"), op, mlp)


class Lfm2Graph(DecoderStack):
    """The pre-norm stack of LFM2's conv and attention layers (tensors named by ``names``,
    lfm2/names.py ``LFM2_NAMES``)."""

    def __init__(self, args: Lfm2Args, names: NameTable, lookup: TensorLookup):
        layers = [_layer(args, names, layer, lookup) for layer in args.layers]
        super().__init__(layers, Norm(const(lookup, names.name("norm.final")), args.eps), names.name("lm_head"),
                         args.hidden_size, args.vocab_size, args.rope.inv_freq())
        self.args = args
