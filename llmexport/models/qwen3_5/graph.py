"""Trace-friendly Qwen3.5 text decoder (the graph MNN runs).

Mirrors transformers' models/qwen3_5/modeling_qwen3_5.py and models/qwen3_5_moe/modeling_qwen3_5_moe.py
with the runtime's interface (decoder/graph.py ``DecoderStack``):
- every RMSNorm of the layers, the final norm and the q/k norms is ``x * (1 + w)`` in fp32
  (Qwen3_5RMSNorm; the graph holds 1 + w, as Gemma's, ``gemma3_graph.gemma_norm``);
- gated full attention (Qwen3_5Attention): ``q_proj`` gives per head ``[query | gate]``
  (``view(.., heads, 2 * head_dim)`` then ``chunk(2)``), per-head q/k norms, rotate-half RoPE on
  the first ``rotary_dim`` dims only (apply_rotary_pos_emb keeps the rest), MNN's Attention op,
  then ``out * sigmoid(gate)`` before ``o_proj``. Text prompts give M-RoPE three equal position
  rows, so ``recomposition_frequencies`` picks the same frequency table whichever row a pair
  reads: 1-D RoPE (tests/test_qwen3_5.py proves it against HF); with the vision tower the graph
  takes the runtime's three rows (qwen_vl/mrope.py, tests/test_qwen3_5_vision.py);
- Gated DeltaNet (Qwen3_5GatedDeltaNet): ``in_proj_qkv`` channel-major into MNN's LinearAttention
  op (``FusedLinearAttention``, gated delta rule: conv + SiLU + split + l2norm + recurrence),
  ``beta = sigmoid(in_proj_b(x))``, ``gate = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)`` in
  fp32 (A_log, dt_bias fp32 graph constants), then Qwen3_5RMSNormGated over each value head
  (plain weight, ``norm(x) * w * silu(z)``) and ``out_proj``;
- the MoE block (Qwen3_5MoeSparseMoeBlock): softmax top-k renormalised (decoder/graph.py
  ``SoftmaxMoe``; each expert a SwiGLU, over one fused gate_up linear where the checkpoint stores
  the experts stacked as Qwen3_5MoeExperts keeps them), plus the shared expert times ``sigmoid(shared_expert_gate(x))``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmexport.models.decoder.args import MoeSpec as RoutedSpec
from llmexport.models.decoder.graph import DecoderStack, PreNormLayer, SoftmaxMoe, SwiGlu, routed_expert
from llmexport.models.decoder.names import MLP, expert_linears
from llmexport.models.gemma3_graph import gemma_norm
from llmexport.models.graph_parts import Norm, TensorLookup, const
from llmexport.models.qwen3_5.args import LayerSpec, MoeSpec, Qwen3_5Args
from llmexport.models.qwen3_5.names import SHARED_MLP
from llmexport.models.qwen_vl.mrope import hf_relative_positions, mrope_cos_sin, pair_rows
from llmexport.models.rope import RopeSpec, rotate_prefix
from llmexport.models.tensor_names import NameTable
from llmexport.trace.ops import GATED_DELTA_RULE, FusedAttention, FusedLinearAttention, PlaceholderLinear


class GatedAttention(nn.Module):
    """Qwen3_5Attention on [1, seq, hidden] (``names``: the table bound to the layer)."""

    def __init__(self, args: Qwen3_5Args, names: NameTable, index: int, lookup: TensorLookup):
        super().__init__()
        h, d = args.hidden_size, args.head_dim
        self.heads, self.kv_heads, self.head_dim, self.rotary_dim = args.num_heads, args.kv_heads, d, args.rotary_dim
        self.q_proj = PlaceholderLinear(names.name("attn.q"), h, 2 * args.num_heads * d)
        self.k_proj = PlaceholderLinear(names.name("attn.k"), h, args.kv_width)
        self.v_proj = PlaceholderLinear(names.name("attn.v"), h, args.kv_width)
        self.o_proj = PlaceholderLinear(names.name("attn.o"), args.num_heads * d, h)
        self.q_norm = gemma_norm(lookup, names.name("norm.q"), args.eps)
        self.k_norm = gemma_norm(lookup, names.name("norm.k"), args.eps)
        self.attn = FusedAttention(index, -1, d ** -0.5)

    def _rotate(self, x, cos, sin):
        return rotate_prefix(x, cos, sin, self.rotary_dim, self.head_dim)

    def forward(self, x, cos, sin, mask):
        d = self.head_dim
        qg = self.q_proj(x).view(1, -1, self.heads, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(1, -1, self.heads * d)
        q = self._rotate(self.q_norm(q), cos, sin)
        k = self._rotate(self.k_norm(self.k_proj(x).view(1, -1, self.kv_heads, d)), cos, sin)
        v = self.v_proj(x).view(1, -1, self.kv_heads, d)
        return self.o_proj(self.attn(q, k, v, mask) * torch.sigmoid(gate))


class GatedDeltaNet(nn.Module):
    """Qwen3_5GatedDeltaNet on [1, seq, hidden]; ``cos``, ``sin`` and ``mask`` are not read (the
    recurrence is causal by construction and positions enter through the conv and the state)."""

    def __init__(self, args: Qwen3_5Args, names: NameTable, index: int, lookup: TensorLookup):
        super().__init__()
        s, h = args.delta, args.hidden_size
        self.v_heads, self.v_dim = s.v_heads, s.v_dim
        self.in_proj_qkv = PlaceholderLinear(names.name("delta.qkv"), h, s.channels)
        self.in_proj_z = PlaceholderLinear(names.name("delta.z"), h, s.value_width)
        self.in_proj_b = PlaceholderLinear(names.name("delta.b"), h, s.v_heads)
        self.in_proj_a = PlaceholderLinear(names.name("delta.a"), h, s.v_heads)
        self.out_proj = PlaceholderLinear(names.name("delta.out"), s.value_width, h)
        self.conv_weight = const(lookup, names.name("delta.conv"))
        self.A_log = const(lookup, names.name("delta.A_log"))
        self.dt_bias = const(lookup, names.name("delta.dt_bias"))
        self.norm = Norm(const(lookup, names.name("delta.norm")), args.eps)
        self.linear_attn = FusedLinearAttention(index, GATED_DELTA_RULE, s.k_heads, s.v_heads, s.k_dim, s.v_dim,
                                                use_qk_l2norm=True)

    def forward(self, x, cos, sin, mask):
        qkv = self.in_proj_qkv(x).transpose(1, 2)  # [1, channels, seq]
        beta = torch.sigmoid(self.in_proj_b(x))
        gate = -self.A_log.exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        out = self.linear_attn(qkv, gate, beta, self.conv_weight)  # [1, seq, v_heads, v_dim]
        z = self.in_proj_z(x).view(1, -1, self.v_heads, self.v_dim)
        out = self.norm(out) * F.silu(z.float())
        return self.out_proj(out.reshape(1, -1, self.v_heads * self.v_dim))


class SparseBlock(nn.Module):
    """Qwen3_5MoeSparseMoeBlock: routed experts (``SoftmaxMoe``, renormalised) plus the shared
    expert gated by ``sigmoid(shared_expert_gate(x))``."""

    def __init__(self, args: Qwen3_5Args, names: NameTable, index: int, stacked: bool):
        super().__init__()
        moe = args.moe
        assert moe is not None, "a sparse block without experts"
        build = routed_expert(args.hidden_size, moe.width, stacked)
        self.routed = SoftmaxMoe(names, index, args.hidden_size, RoutedSpec(moe.num_experts, moe.top_k, moe.width,
                                                                             normalize=True),
                                 lambda e: build(names.names(expert_linears(stacked), expert=e)))
        self.shared_expert = SwiGlu(names.names(SHARED_MLP), args.hidden_size, moe.shared_width)
        self.shared_expert_gate = PlaceholderLinear(names.name("shared.router"), args.hidden_size, 1)

    def forward(self, x):
        return self.routed(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def _layer(args: Qwen3_5Args, names: NameTable, layer: LayerSpec, lookup: TensorLookup,
           stacked: bool) -> PreNormLayer:
    p = names.bind(layer=layer.index)
    mixer = (GatedDeltaNet if layer.linear else GatedAttention)(args, p, layer.index, lookup)
    mlp = SparseBlock(args, p, layer.index, stacked) if args.moe else SwiGlu(p.names(MLP), args.hidden_size,
                                                                    args.intermediate_size)
    return PreNormLayer(gemma_norm(lookup, p.name("norm.input"), args.eps),
                        gemma_norm(lookup, p.name("norm.post_attention"), args.eps), mixer, mlp)


class Qwen3_5Graph(DecoderStack):
    """The pre-norm stack with Qwen3.5's layers; RoPE tables over the rotated prefix only;
    ``stacked``: the checkpoint stores its routed experts stacked (names.py ``QWEN3_5_STACKED``);
    ``mrope``: ``position_ids`` are the runtime's [3, seq] M-RoPE rows (an export with the vision
    tower, qwen_vl/mrope.py), else [1, seq]."""

    pair_rows: torch.Tensor

    def __init__(self, args: Qwen3_5Args, names: NameTable, lookup: TensorLookup, stacked: bool = False,
                 mrope: bool = False):
        layers = [_layer(args, names, layer, lookup, stacked) for layer in args.layers]
        rope = RopeSpec(args.rope_theta, args.rotary_dim, args.rotary_dim // 2)
        super().__init__(layers, gemma_norm(lookup, names.name("norm.final"), args.eps), names.name("lm_head"),
                         args.hidden_size, args.vocab_size, rope.inv_freq())
        self.mrope = mrope
        self.register_buffer("pair_rows", pair_rows(args.mrope_section, args.rotary_dim // 2), persistent=False)

    def rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.mrope:
            return super().rope(position_ids)
        return mrope_cos_sin(hf_relative_positions(position_ids), self.inv_freq, self.pair_rows)


__all__ = ["Qwen3_5Graph", "GatedAttention", "GatedDeltaNet", "SparseBlock", "MoeSpec", "routed_expert"]
