"""Placeholder ops: one eager reference and one ONNX symbolic form per op, in one place.

While tracing for MNN (``custom_ops(True)``) each op is emitted as a node of the
``LlmExport`` ONNX domain carrying its attributes; MNN's converter keeps such nodes as
``Extra`` ops and ``llmexport.mnn.rebuild`` turns them into MNN's own ops. Outside that
context the same modules compute the real thing in torch, so a test can compare a rewritten
model with HF before any ONNX exists, and a plain-ONNX export (for onnxruntime) traces the
reference math with real weights.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Iterator, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

DOMAIN = "LlmExport"
_state = {"custom": False}


@contextlib.contextmanager
def custom_ops(enabled: bool = True) -> Iterator[None]:
    """Within this context, placeholder modules trace as custom ONNX ops."""
    previous = _state["custom"]
    _state["custom"] = enabled
    try:
        yield
    finally:
        _state["custom"] = previous


def emitting_custom_ops() -> bool:
    return _state["custom"] and torch.onnx.is_in_onnx_export()


def _sizes(value) -> list:
    from torch.onnx.symbolic_helper import _get_tensor_sizes

    return list(_get_tensor_sizes(value) or [])


class _LinearOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, in_features: int, out_features: int, has_bias: int, name: str):
        return x.new_zeros(list(x.shape[:-1]) + [out_features])

    @staticmethod
    def symbolic(g, x, in_features, out_features, has_bias, name):
        out = g.op(f"{DOMAIN}::Linear", x, in_features_i=in_features, out_features_i=out_features,
                   has_bias_i=has_bias, name_s=name)
        sizes = _sizes(x)
        if sizes:
            out.setType(x.type().with_sizes(sizes[:-1] + [out_features]))
        return out


class PlaceholderLinear(nn.Module):
    """A linear layer whose weight stays outside the traced graph.

    ``name`` ties the graph node to the weight: the weight writer asks the architecture for
    the tensors of that name. For eager use, ``bind`` attaches real (or dequantized) weights.
    """

    def __init__(self, name: str, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.name = name
        self.in_features = in_features
        self.out_features = out_features
        self.has_bias = bias
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def bind(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"{self.name}: weight shape {tuple(weight.shape)} != "
                             f"{(self.out_features, self.in_features)}")
        self.weight = weight
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if emitting_custom_ops():
            return _LinearOp.apply(x, self.in_features, self.out_features, int(self.has_bias), self.name)
        if self.weight is None:
            raise RuntimeError(f"{self.name}: no weight bound for eager execution")
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"{self.name}, in={self.in_features}, out={self.out_features}, bias={self.has_bias}"


class _AttentionOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, name: str, layer_index: int, kv_shared_layer_index: int, scale: float):
        return q.new_zeros([q.shape[0], q.shape[1], q.shape[2] * q.shape[3]])

    @staticmethod
    def symbolic(g, q, k, v, mask, name, layer_index, kv_shared_layer_index, scale):
        out = g.op(f"{DOMAIN}::Attention", q, k, v, mask, name_s=name, layer_index_i=layer_index,
                   kv_shared_layer_index_i=kv_shared_layer_index, scale_f=scale)
        sizes = _sizes(q)
        if len(sizes) == 4:
            heads, dim = sizes[2], sizes[3]
            width = heads * dim if isinstance(heads, int) and isinstance(dim, int) else None
            out.setType(q.type().with_sizes([sizes[0], sizes[1], width]))
        return out


class FusedAttention(nn.Module):
    """Softmax attention over a KV cache, MNN's ``Attention`` op at runtime.

    q: [1, seq, heads, dim]; k, v: [1, kv_seq, kv_heads, dim]; mask: additive float,
    broadcastable to [1, 1, seq, kv_seq]. Output [1, seq, heads * dim].
    ``kv_shared_layer_index`` >= 0 makes the runtime read the KV cache of that layer instead
    of appending k/v (which then only carry their shape). The op is named after its layer.
    """

    def __init__(self, layer_index: int, kv_shared_layer_index: int, scale: float):
        super().__init__()
        self.name = f"/layers.{layer_index}/self_attn/Attention"
        self.layer_index = layer_index
        self.kv_shared_layer_index = kv_shared_layer_index
        self.scale = scale

    def forward(self, q, k, v, mask):
        if emitting_custom_ops():
            return _AttentionOp.apply(q, k, v, mask, self.name, self.layer_index,
                                      self.kv_shared_layer_index, self.scale)
        return attention_reference(q, k, v, mask, self.scale)


def attention_reference(q, k, v, mask, scale: float) -> torch.Tensor:
    """Eager attention with grouped KV heads; softmax in fp32 as HF's eager path does."""
    heads, kv_heads = q.shape[2], k.shape[2]
    q = q.transpose(1, 2)
    k = k.transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    v = v.transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale + mask
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.matmul(probs, v).transpose(1, 2)
    return out.reshape(out.shape[0], out.shape[1], -1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, ``x * (1 / sqrt(mean(x^2) + eps)) * weight``.

    Spelled so that MNN's converter folds it into one ``LayerNorm`` op (useRMSNorm, the weight
    as its gamma; tools/converter/source/optimizer/merge/FuseLayerNormRMS*.cpp match exactly
    this pattern, not ``pow(., -0.5)``), and without casts of tensors that are already fp32:
    traced, each would be a Cast op that blocks the match and costs a dispatch per call.
    The weight must have the normalised width (the fold takes it as the per-element gamma).
    """
    xf = x if x.dtype == torch.float32 else x.float()
    out = xf * (1.0 / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps))
    if weight is not None:
        out = out * (weight if weight.dtype == torch.float32 else weight.float())
    return out if out.dtype == x.dtype else out.to(x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """gelu with the tanh approximation, spelled out (ONNX opsets before 20 lack it) in the
    order MNN's converter folds into its GELU op (tools/converter/source/optimizer/merge/
    FuseGeLu.cpp: ``x * ((tanh((x + pow(x, 3) * c) * k) + 1) * 0.5)``)."""
    return x * (0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0)))))


def gelu_erf(x: torch.Tensor) -> torch.Tensor:
    """The exact (erf) gelu, spelled out: exported as ONNX ``Gelu`` (opset 20) it becomes MNN's
    GELU op, which computes the tanh approximation (about 1e-4 relative off on a tower's output,
    measured); ``Erf`` is libm's ``erff`` in MNN's CPU backend."""
    return x * (0.5 * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0)))))


class GatedMlp(nn.Module):
    """``down(act(gate(x)) * up(x))`` with placeholder linears named ``names`` (the family's names
    of gate, up and down); the families differ only in the activation (Gemma4: tanh-gelu,
    K2-Horizon: SiLU)."""

    def __init__(self, names: Sequence[str], hidden: int, width: int, activation):
        super().__init__()
        gate, up, down = names
        self.gate_proj = PlaceholderLinear(gate, hidden, width)
        self.up_proj = PlaceholderLinear(up, hidden, width)
        self.down_proj = PlaceholderLinear(down, width, hidden)
        self.activation = activation

    def forward(self, x):
        return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))


class FusedGatedMlp(nn.Module):
    """``down(act(gate) * up)`` where one placeholder linear ``gate_up`` [2 * width, hidden] gives
    gate then up (the experts of a stacked checkpoint: Gemma4's tanh-gelu, Qwen3.5-MoE's SiLU);
    ``names``: gate_up's and down's."""

    def __init__(self, names: Sequence[str], hidden: int, width: int, activation):
        super().__init__()
        gate_up, down = names
        self.gate_up_proj = PlaceholderLinear(gate_up, hidden, 2 * width)
        self.down_proj = PlaceholderLinear(down, width, hidden)
        self.activation = activation

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.activation(gate) * up)


class _MoEOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weights, chosen, num_experts: int, top_k: int, layer_id: int, out_features: int):
        return hidden.new_zeros(hidden.shape[0], out_features)

    @staticmethod
    def symbolic(g, hidden, weights, chosen, num_experts, top_k, layer_id, out_features):
        out = g.op(f"{DOMAIN}::MoE", hidden, weights, chosen, num_experts_i=num_experts, top_k_i=top_k,
                   layer_id_i=layer_id)
        sizes = _sizes(hidden)
        if sizes:
            out.setType(hidden.type().with_sizes(sizes[:-1] + [out_features]))
        return out


def expert_subgraph_name(layer_id: int, expert: int) -> str:
    """The subgraph name MNN's MoE module looks up for one expert (express/module/MoEModule.cpp)."""
    return f"/expert/{layer_id}_{expert}"


def dense_mixture(experts: nn.ModuleList, hidden, weights, chosen):
    """Every expert on every token, weighted by a dense [tokens, experts] matrix (zero for the
    experts not chosen) and summed in fp32; equal to a gather/scatter over the chosen ones."""
    one_hot = (chosen.unsqueeze(-1) == torch.arange(len(experts))).to(weights.dtype)
    dense = (one_hot * weights.unsqueeze(-1)).sum(dim=-2)
    out: torch.Tensor | None = None
    for e, expert in enumerate(experts):
        term = expert(hidden).float() * dense[..., e:e + 1]
        out = term if out is None else out + term
    assert out is not None, "a mixture of no experts"
    return out.to(hidden.dtype)


class FusedMoE(nn.Module):
    """Routed experts, MNN's ``MoE`` op at runtime: only the chosen experts run.

    hidden: [tokens, hidden]; weights: [tokens, top_k] float; chosen: [tokens, top_k] expert ids.
    Each expert maps [n, hidden] -> [n, out_features]; at runtime the experts are subgraphs named
    by ``expert_subgraph_name``, whose outputs MNN weights and sums.
    """

    def __init__(self, experts: nn.ModuleList, top_k: int, layer_id: int, out_features: int):
        super().__init__()
        self.experts = experts
        self.top_k = top_k
        self.layer_id = layer_id
        self.out_features = out_features

    def forward(self, hidden, weights, chosen):
        if emitting_custom_ops():
            return _MoEOp.apply(hidden, weights.float(), chosen.to(torch.int32), len(self.experts), self.top_k,
                                self.layer_id, self.out_features)
        return dense_mixture(self.experts, hidden, weights, chosen)


#: MNN's LinearAttention kinds (LinearAttentionParam.attn_type, source/backend/cpu/CPULinearAttention.cpp)
GATED_DELTA_RULE, SHORT_CONV = "gated_delta_rule", "short_conv"


class _LinearAttentionOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, gate, beta, conv_weight, name: str, attn_type: str, num_k_heads: int, num_v_heads: int,
                head_k_dim: int, head_v_dim: int, use_qk_l2norm: int):
        return qkv.new_zeros([qkv.shape[0], qkv.shape[2], num_v_heads, head_v_dim])

    @staticmethod
    def symbolic(g, qkv, gate, beta, conv_weight, name, attn_type, num_k_heads, num_v_heads, head_k_dim, head_v_dim,
                 use_qk_l2norm):
        out = g.op(f"{DOMAIN}::LinearAttention", qkv, gate, beta, conv_weight, name_s=name, attn_type_s=attn_type,
                   num_k_heads_i=num_k_heads, num_v_heads_i=num_v_heads, head_k_dim_i=head_k_dim,
                   head_v_dim_i=head_v_dim, use_qk_l2norm_i=use_qk_l2norm)
        sizes = _sizes(qkv)
        if len(sizes) == 3:
            out.setType(qkv.type().with_sizes([sizes[0], sizes[2], num_v_heads, head_v_dim]))
        return out


class FusedLinearAttention(nn.Module):
    """A recurrent token mixer, MNN's ``LinearAttention`` op at runtime: the op keeps a causal
    depthwise conv's last ``kernel - 1`` inputs and (gated delta rule) a [v_heads, k_dim, v_dim]
    state per layer between calls, as the Attention op keeps its KV cache.

    qkv: [1, channels, seq] (channel-major, before the conv); gate, beta: [1, seq, v_heads];
    conv_weight: [channels, 1, kernel]. Output [1, seq, v_heads, v_dim].

    - ``short_conv`` (LFM2): channels = 3 * width as (B, C, x); out = C * conv(B * x), no activation;
      one "head" of ``v_dim = width`` (gate and beta unused).
    - ``gated_delta_rule`` (Qwen3.5): SiLU(conv(qkv)) split into q, k [k_heads, k_dim] and v
      [v_heads, v_dim]; q and k repeated per value head (each k head serves consecutive v heads),
      optionally l2-normalised (``x / sqrt(sum(x^2) + 1e-6)``), q scaled by 1/sqrt(k_dim); per token
      ``S = exp(gate) * S; S += k (beta (v - S^T k))^T; out = S^T q``.
    """

    def __init__(self, layer_index: int, attn_type: str, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, use_qk_l2norm: bool):
        super().__init__()
        if attn_type not in (GATED_DELTA_RULE, SHORT_CONV):
            raise ValueError(f"unknown linear attention type {attn_type!r}")
        self.name = f"/layers.{layer_index}/self_attn/LinearAttention"
        self.attn_type = attn_type
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.use_qk_l2norm = use_qk_l2norm

    def forward(self, qkv, gate, beta, conv_weight):
        if emitting_custom_ops():
            return _LinearAttentionOp.apply(qkv, gate, beta, conv_weight, self.name, self.attn_type,
                                            self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim,
                                            int(self.use_qk_l2norm))
        return self.reference(qkv, gate, beta, conv_weight)[0]

    def reference(self, qkv, gate, beta, conv_weight, state: "LinearAttentionState | None" = None):
        """The op's math in fp32 from ``state`` (None: zeros, a fresh sequence); returns the
        output and the state after the last token."""
        kernel = conv_weight.shape[-1]
        qkv = qkv.float()
        if self.attn_type == SHORT_CONV:
            width = qkv.shape[1] // 3
            b, c, x = qkv[:, :width], qkv[:, width:2 * width], qkv[:, 2 * width:]
            conv_in, conv_state = _with_conv_state(b * x, kernel, None if state is None else state.conv)
            out = c * F.conv1d(conv_in, conv_weight.float(), groups=width)
            return out.transpose(1, 2).unsqueeze(2), LinearAttentionState(conv_state, None)
        conv_in, conv_state = _with_conv_state(qkv, kernel, None if state is None else state.conv)
        mixed = F.silu(F.conv1d(conv_in, conv_weight.float(), groups=qkv.shape[1])).transpose(1, 2)
        key_dim = self.num_k_heads * self.head_k_dim
        q, k, v = mixed[..., :key_dim], mixed[..., key_dim:2 * key_dim], mixed[..., 2 * key_dim:]
        out, recurrent = gated_delta_rule(q.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
                                          k.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
                                          v.unflatten(-1, (self.num_v_heads, self.head_v_dim)),
                                          gate.float(), beta.float(), self.use_qk_l2norm,
                                          None if state is None else state.recurrent)
        return out, LinearAttentionState(conv_state, recurrent)


class LinearAttentionState(NamedTuple):
    """What the LinearAttention op carries between calls: the conv's last inputs [1, channels,
    kernel - 1] and the gated delta rule's state [1, v_heads, k_dim, v_dim] (None for short_conv)."""

    conv: torch.Tensor
    recurrent: torch.Tensor | None


def _with_conv_state(x: torch.Tensor, kernel: int, conv_state: torch.Tensor | None):
    """``x`` [1, channels, seq] after the conv's carried inputs (zeros for a fresh sequence), and
    the last ``kernel - 1`` inputs to carry on."""
    if conv_state is None:
        conv_state = x.new_zeros(x.shape[0], x.shape[1], kernel - 1)
    padded = torch.cat([conv_state, x], dim=-1)
    return padded, padded[..., padded.shape[-1] - (kernel - 1):]


def gated_delta_rule(q, k, v, gate, beta, l2norm: bool, state: torch.Tensor | None = None):
    """The gated delta rule token by token in fp32 (transformers' torch_recurrent_gated_delta_rule,
    models/qwen3_5/modeling_qwen3_5.py). q, k: [1, seq, k_heads, k_dim]; v: [1, seq, v_heads, v_dim];
    gate, beta: [1, seq, v_heads]. Returns [1, seq, v_heads, v_dim] and the final state."""
    # each k head serves ``repeat`` consecutive v heads: a Gather along the heads (repeat_interleave
    # would trace as an Expand fixed to the traced length)
    heads = torch.arange(k.shape[2]).repeat_interleave(v.shape[2] // k.shape[2])
    q, k = q.index_select(2, heads), k.index_select(2, heads)
    if l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q / math.sqrt(q.shape[-1])
    if state is None:
        state = v.new_zeros(v.shape[0], v.shape[2], k.shape[-1], v.shape[-1])
    # Traced for plain ONNX, a Python loop would be unrolled at the traced length: the scripted
    # copy of the same function exports as an ONNX Loop over the sequence instead. Eager runs the
    # Python function itself (no TorchScript executor, so no fused kernels change its numerics).
    recurrence = _scripted_recurrence() if torch.onnx.is_in_onnx_export() else _recurrence
    return recurrence(q, k, v, gate, beta, state)


def _recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``gated_delta_rule``'s per-token loop on prepared q, k (repeated per value head, normalised,
    q scaled) from ``state``; TorchScript-compatible (``_scripted_recurrence``)."""
    outputs: list[torch.Tensor] = []
    # the length read from ``gate`` (a projection of the input): traced, the conv's output shape
    # is taken from the example and would fix the trip count at the traced length
    for t in range(gate.shape[1]):
        state = state * gate[:, t].exp().unsqueeze(-1).unsqueeze(-1)
        predicted = (state * k[:, t].unsqueeze(-1)).sum(-2)
        delta = (v[:, t] - predicted) * beta[:, t].unsqueeze(-1)
        state = state + k[:, t].unsqueeze(-1) * delta.unsqueeze(-2)
        outputs.append((state * q[:, t].unsqueeze(-1)).sum(-2))
    return torch.stack(outputs, dim=1), state


@functools.cache
def _scripted_recurrence():
    """``_recurrence`` compiled by TorchScript (once, on first export)."""
    return torch.jit.script(_recurrence)
