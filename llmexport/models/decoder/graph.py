"""Trace-friendly pre-norm decoder: the graph MNN runs for Llama, Qwen3, Qwen3-MoE and K2-Horizon.

The runtime's interface: embeddings come in as ``[seq, 1, hidden]`` (the runtime does the
lookup; these families have no embedding scale), attention goes through ``FusedAttention``
(MNN's KV-cached Attention op, 1/sqrt(head_dim) scale), routed experts through ``FusedMoE``
(MNN's MoE op, only the chosen experts run). The layer is HF's
``h = x + attn(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h))``
(LlamaDecoderLayer, Qwen3DecoderLayer, Qwen3MoeDecoderLayer). Families pass in their own norms,
attention values and MLPs; ``DenseDecoderGraph`` builds the Llama/Qwen3 variant from ``DecoderArgs``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from llmexport.models.decoder.args import DecoderArgs, LayerSpec, MoeSpec
from llmexport.models.decoder.family import expert_template
from llmexport.models.decoder.names import MLP, Biases, expert_linears, has_bias
from llmexport.models.graph_parts import Norm, TensorLookup, const
from llmexport.models.rope import rope_cos_sin, rotate
from llmexport.models.tensor_names import NameTable
from llmexport.spec import ExpertTemplate
from llmexport.trace.ops import FusedAttention, FusedGatedMlp, FusedMoE, GatedMlp, PlaceholderLinear


class Attention(nn.Module):
    """GQA attention on [1, seq, hidden]: the projections ``attn.{q,k,v,o}`` of ``names`` (the
    family's name table bound to the layer), optional per-head q/k norms before RoPE (Qwen3,
    K2-Horizon, Gemma3), MNN's Attention op with ``scale`` (default 1/sqrt(head_dim)). Subclasses
    replace ``init_values``/``values`` (K2-Horizon's MoVA)."""

    def __init__(self, names: NameTable, index: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 bias: Biases, qk_norms: tuple[nn.Module, nn.Module] | None = None, rope: bool = True,
                 scale: float | None = None,
                 **value_options):
        super().__init__()
        self.rope = rope  # SmolLM3's NoPE layers attend without rotating q and k
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = PlaceholderLinear(names.name("attn.q"), hidden, heads * head_dim, has_bias(bias, "attn.q"))
        self.k_proj = PlaceholderLinear(names.name("attn.k"), hidden, kv_heads * head_dim, has_bias(bias, "attn.k"))
        self.o_proj = PlaceholderLinear(names.name("attn.o"), heads * head_dim, hidden, has_bias(bias, "attn.o"))
        self.init_values(names, hidden, kv_heads * head_dim, has_bias(bias, "attn.v"), **value_options)
        self.qk_norm = qk_norms is not None
        if qk_norms is not None:
            self.q_norm, self.k_norm = qk_norms
        self.attn = FusedAttention(index, -1, head_dim ** -0.5 if scale is None else scale)

    def init_values(self, names: NameTable, hidden: int, width: int, bias: bool, **options: Any) -> None:
        self.v_proj = PlaceholderLinear(names.name("attn.v"), hidden, width, bias)

    def values(self, x):
        return self.v_proj(x)

    def forward(self, x, cos, sin, mask):
        q = self.q_proj(x).view(1, -1, self.heads, self.head_dim)
        k = self.k_proj(x).view(1, -1, self.kv_heads, self.head_dim)
        v = self.values(x).view(1, -1, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        d = self.head_dim
        if self.rope:
            q, k = rotate(q, cos, sin, d), rotate(k, cos, sin, d)
        return self.o_proj(self.attn(q, k, v, mask))


class PreNormLayer(nn.Module):
    def __init__(self, input_layernorm: nn.Module, post_attention_layernorm: nn.Module, self_attn: nn.Module,
                 mlp: nn.Module):
        super().__init__()
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        self.self_attn = self_attn
        self.mlp = mlp

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """Inputs (runtime layout): input_ids = embeddings [seq, 1, hidden], attention_mask
    [1, 1, seq, kv] float, position_ids int32 [1, seq], logits_index int32 [1].
    Outputs: logits [1, n, vocab], hidden_states [1, n, hidden] (final-normed, sliced).
    With ``sliding`` (one flag per layer) the mask is the runtime's "mix" pair [2, 1, 1, seq, kv]:
    full layers read slice 0, sliding layers slice 1."""

    inv_freq: torch.Tensor

    def __init__(self, layers: Sequence[nn.Module], norm: nn.Module, head: str, hidden: int, vocab: int,
                 inv_freq: torch.Tensor, sliding: Sequence[bool] | None = None):
        super().__init__()
        self.hidden = hidden
        self.sliding = tuple(sliding) if sliding is not None and any(sliding) else None
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = PlaceholderLinear(head, hidden, vocab)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids, attention_mask, position_ids, logits_index, *extra):
        x = input_ids.view(1, -1, self.hidden)
        cos, sin = self.rope(position_ids)  # [1, seq, 1, head_dim]
        # unbind (one Split op) rather than indexing each layer's slice
        masks = attention_mask.unbind(0) if self.sliding else None
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, masks[int(self.sliding[i])] if masks and self.sliding else attention_mask)
            x = self.after_layer(i, x, *extra)
        x = x[:, logits_index.to(torch.int64):, :]
        hidden = self.norm(x)
        return self.lm_head(hidden), hidden

    def rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the runtime's ``position_ids`` [1, seq] (a family with other positions
        overrides it)."""
        return rope_cos_sin(position_ids, self.inv_freq)

    def after_layer(self, index: int, x: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        """Layer ``index``'s output, changed by the graph's inputs after the standard four
        (``extra``: Qwen3-VL's DeepStack levels); none here."""
        return x


class SwiGlu(GatedMlp):
    """SiLU-gated MLP (placeholder names ``names``: gate, up, down); also the routed expert template."""

    def __init__(self, names: Sequence[str], hidden: int, width: int):
        super().__init__(names, hidden, width, F.silu)


class FusedSwiGlu(FusedGatedMlp):
    """SiLU-gated MLP with one fused gate_up linear (placeholder names ``names``: gate_up, down):
    the routed expert of a checkpoint that stores its experts stacked."""

    def __init__(self, names: Sequence[str], hidden: int, width: int):
        super().__init__(names, hidden, width, F.silu)


def routed_expert(hidden: int, width: int, stacked: bool) -> Callable[[Sequence[str]], nn.Module]:
    """A routed expert from its linears' names (``expert_linears``): SwiGLU over gate, up and down,
    or over one fused gate_up (gate rows first, as Qwen3_5MoeExperts and Qwen3VLMoeTextExperts
    split it) where the checkpoint stores the experts stacked."""
    return lambda linears: (FusedSwiGlu if stacked else SwiGlu)(linears, hidden, width)


def swiglu_expert_templates(names: NameTable, hidden: int, width: int, sparse: Sequence[int],
                            num_experts: int, stacked: bool = False) -> list[ExpertTemplate]:
    """The routed SwiGLU experts (``expert_linears(stacked)`` of ``moe.expert``) of the ``sparse``
    layers as one MoE template, MoE layer_id = layer index; none without sparse layers."""
    if not sparse:
        return []
    return [expert_template(names, "moe.expert", expert_linears(stacked), routed_expert(hidden, width, stacked),
                            hidden, ((layer, layer, e) for layer in sparse for e in range(num_experts)))]


class SoftmaxMoe(nn.Module):
    """Qwen3-MoE's sparse block (Qwen3MoeTopKRouter + experts) on [1, seq, hidden]: softmax over
    the router logits in fp32, top-k, optionally renormalised to sum 1; SwiGLU experts on MNN's
    MoE op (layer_id = layer index). ``names``: the family's table bound to the layer;
    ``expert``: builds expert ``e`` (``routed_expert`` over its ``expert_linears``)."""

    def __init__(self, names: NameTable, index: int, hidden: int, moe: MoeSpec, expert: Callable[[int], nn.Module]):
        super().__init__()
        self.hidden, self.spec = hidden, moe
        self.gate = PlaceholderLinear(names.name("moe.router"), hidden, moe.num_experts)
        experts = nn.ModuleList(expert(e) for e in range(moe.num_experts))
        self.experts = FusedMoE(experts, moe.top_k, index, hidden)

    def forward(self, x):
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(x.view(-1, self.hidden), weights.view(-1, self.spec.top_k),
                           chosen.view(-1, self.spec.top_k))
        return out.view(1, -1, self.hidden)


def _layer(args: DecoderArgs, names: NameTable, layer: LayerSpec, lookup: TensorLookup,
           stacked: bool) -> PreNormLayer:
    p = names.bind(layer=layer.index)
    norm = lambda key: Norm(const(lookup, p.name(key)), args.eps)  # noqa: E731
    qk = (norm("norm.q"), norm("norm.k")) if args.qk_norm else None
    attn = Attention(p, layer.index, args.hidden_size, args.num_heads, args.kv_heads, args.head_dim,
                     args.biases, qk, rope=layer.rope)
    assert args.moe is not None or not layer.sparse, "a sparse layer without experts"
    if args.moe and layer.sparse:
        build = routed_expert(args.hidden_size, args.moe.width, stacked)
        mlp: nn.Module = SoftmaxMoe(p, layer.index, args.hidden_size, args.moe,
                                    lambda e: build(p.names(expert_linears(stacked), expert=e)))
    else:
        mlp = SwiGlu(p.names(MLP), args.hidden_size, args.intermediate_size)
    return PreNormLayer(norm("norm.input"), norm("norm.post_attention"), attn, mlp)


class DenseDecoderGraph(DecoderStack):
    """Llama / Qwen3 / Qwen3-MoE: RMSNorm everywhere, per-head q/k RMSNorm when ``qk_norm``;
    the tensors named by ``names`` (decoder_names.LLAMA_LAYOUT or a family's variant of it);
    ``stacked``: the routed experts are rows of stacked tensors (``STACKED_EXPERT`` linears)."""

    def __init__(self, args: DecoderArgs, names: NameTable, lookup: TensorLookup, stacked: bool = False):
        layers = [_layer(args, names, layer, lookup, stacked) for layer in args.layers]
        super().__init__(layers, Norm(const(lookup, names.name("norm.final")), args.eps), names.name("lm_head"),
                         args.hidden_size, args.vocab_size, args.rope.inv_freq(),
                         [layer.sliding for layer in args.layers])
