"""Trace-friendly Phi-3 decoder (HF Phi3DecoderLayer / Phi3Attention / Phi3MLP): fused qkv and
gate_up projections split in the graph, partial rotary, longrope's attention factor on cos/sin."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmexport.models.decoder.graph import DecoderStack, PreNormLayer
from llmexport.models.graph_parts import Norm, TensorLookup, const
from llmexport.models.phi3_args import Phi3Args
from llmexport.models.rope import rotate_prefix
from llmexport.models.tensor_names import NameTable
from llmexport.trace.ops import FusedAttention, PlaceholderLinear


class FusedQkvAttention(nn.Module):
    def __init__(self, args: Phi3Args, names: NameTable, index: int):
        super().__init__()
        a = args
        self.heads, self.kv_heads, self.head_dim, self.rotary_dim = a.num_heads, a.kv_heads, a.head_dim, a.rotary_dim
        self.widths = [a.num_heads * a.head_dim, a.kv_width, a.kv_width]
        self.factor = a.attention_factor
        self.qkv_proj = PlaceholderLinear(names.name("attn.qkv"), a.hidden_size, sum(self.widths))
        self.o_proj = PlaceholderLinear(names.name("attn.o"), self.widths[0], a.hidden_size)
        self.attn = FusedAttention(index, -1, a.head_dim ** -0.5)

    def _rotate(self, x, cos, sin):
        return rotate_prefix(x, cos, sin, self.rotary_dim, self.head_dim)

    def forward(self, x, cos, sin, mask):
        if self.factor != 1.0:
            cos, sin = cos * self.factor, sin * self.factor
        q, k, v = self.qkv_proj(x).split(self.widths, dim=-1)
        q = self._rotate(q.view(1, -1, self.heads, self.head_dim), cos, sin)
        k = self._rotate(k.view(1, -1, self.kv_heads, self.head_dim), cos, sin)
        return self.o_proj(self.attn(q, k, v.view(1, -1, self.kv_heads, self.head_dim), mask))


class FusedGateUpMlp(nn.Module):
    def __init__(self, names: NameTable, hidden: int, width: int):
        super().__init__()
        self.gate_up_proj = PlaceholderLinear(names.name("mlp.gate_up"), hidden, 2 * width)
        self.down_proj = PlaceholderLinear(names.name("mlp.down"), width, hidden)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * F.silu(gate))


class Phi3Graph(DecoderStack):
    def __init__(self, args: Phi3Args, names: NameTable, lookup: TensorLookup):
        layers = []
        for i in args.layers:
            p = names.bind(layer=i)
            layers.append(PreNormLayer(Norm(const(lookup, p.name("norm.input")), args.eps),
                                       Norm(const(lookup, p.name("norm.post_attention")), args.eps),
                                       FusedQkvAttention(args, p, i), FusedGateUpMlp(p, args.hidden_size,
                                                                                     args.intermediate_size)))
        super().__init__(layers, Norm(const(lookup, names.name("norm.final")), args.eps), names.name("lm_head"),
                         args.hidden_size, args.vocab_size, torch.tensor(args.inv_freq, dtype=torch.float32),
                         [bool(args.sliding_window)] * len(layers))
