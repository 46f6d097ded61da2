"""Trace-friendly Gemma4 text decoder (the graph MNN runs).

Mirrors transformers 5.x ``Gemma4TextModel`` / ``Gemma4TextDecoderLayer`` (modeling_gemma4.py)
with the runtime's interface: token embeddings come in unscaled as ``[seq, 1, hidden]`` (the
runtime does the lookup, the graph applies sqrt(hidden)); per-layer embeddings come in already
scaled; attention goes through ``FusedAttention`` which owns the KV cache. Big matrices are
``PlaceholderLinear``; norm gammas and scalars are small constants of the graph.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from llmexport.models.decoder.names import MLP
from llmexport.models.gemma4.args import SLIDING, Gemma4TextArgs, LayerSpec
from llmexport.models.gemma4.media import open_media_spans, unmark_media
from llmexport.models.gemma4.names import EXPERT, MOE_NORMS
from llmexport.models.graph_parts import Norm, TensorLookup, head_outputs
from llmexport.models.graph_parts import const as _const
from llmexport.models.layer_types import layer_masks, layer_ropes, register_ropes
from llmexport.models.rope import rotate as _rotate
from llmexport.models.tensor_names import NameTable
from llmexport.trace.ops import (
    FusedAttention,
    FusedGatedMlp,
    FusedMoE,
    GatedMlp,
    PlaceholderLinear,
    emitting_custom_ops,
    gelu_tanh,
    rms_norm,
)


def _act(x: torch.Tensor) -> torch.Tensor:
    # HF's gelu_pytorch_tanh, written out so that MNN's converter folds it into one GELU op.
    return gelu_tanh(x)


class Attention(nn.Module):
    """``names``: the family's name table bound to the layer (also for the classes below)."""

    def __init__(self, args: Gemma4TextArgs, names: NameTable, layer: LayerSpec, lookup: TensorLookup):
        super().__init__()
        h, d = args.hidden_size, layer.head_dim
        self.layer = layer
        self.heads = args.num_heads
        self.q_proj = PlaceholderLinear(names.name("attn.q"), h, args.num_heads * d)
        self.o_proj = PlaceholderLinear(names.name("attn.o"), args.num_heads * d, h)
        self.q_norm = Norm(_const(lookup, names.name("norm.q")), args.eps)
        if not layer.shares_kv:
            self.k_proj = PlaceholderLinear(names.name("attn.k"), h, layer.kv_heads * d)
            self.v_proj = None if layer.k_eq_v else PlaceholderLinear(names.name("attn.v"), h, layer.kv_heads * d)
            self.k_norm = Norm(_const(lookup, names.name("norm.k")), args.eps)
        # HF Gemma4 uses attention scaling 1.0 (q/k are RMS-normalised instead).
        self.attn = FusedAttention(layer.index, layer.kv_source, 1.0)

    def forward(self, x, cos, sin, mask, kv_store: dict[int, tuple[torch.Tensor, torch.Tensor]]):
        layer = self.layer
        q = self.q_proj(x).view(1, -1, self.heads, layer.head_dim)
        q = _rotate(self.q_norm(q), cos, sin, layer.head_dim)
        if layer.shares_kv:
            k, v = kv_store[layer.kv_source]
            if emitting_custom_ops():
                # The runtime reads the source layer's cache; k/v only carry their shape, which a
                # static slice of q gives in one op (zeros of a traced shape cost ~6).
                k = v = q[:, :, : layer.kv_heads, :]
        else:
            k = self.k_proj(x).view(1, -1, layer.kv_heads, layer.head_dim)
            # K=V: values are the raw k_proj output (v_norm, no k_norm, no RoPE).
            v = k if self.v_proj is None else self.v_proj(x).view(1, -1, layer.kv_heads, layer.head_dim)
            k = _rotate(self.k_norm(k), cos, sin, layer.head_dim)
            v = rms_norm(v, None, self.k_norm.eps)
            kv_store[layer.index] = (k, v)
        return self.o_proj(self.attn(q, k, v, mask))


class Mlp(GatedMlp):
    """Gemma4's MLP: tanh-gelu gating (placeholder names ``names``: gate, up, down)."""

    def __init__(self, names: Sequence[str], hidden: int, width: int):
        super().__init__(names, hidden, width, _act)


class Expert(FusedGatedMlp):
    """One routed expert (HF Gemma4TextExperts row): [n, hidden] -> [n, hidden]; ``names``: its
    gate_up and down projections'."""

    def __init__(self, names: Sequence[str], hidden: int, width: int):
        super().__init__(names, hidden, width, _act)


class MoE(nn.Module):
    """Router + routed experts (HF Gemma4TextRouter / Gemma4TextExperts).

    Routing: RMSNorm without scale, times ``scale * hidden^-0.5``, linear, softmax in fp32,
    top-k, renormalise, times ``per_expert_scale``; the chosen experts run in MNN's MoE op.
    """

    def __init__(self, args: Gemma4TextArgs, names: NameTable, index: int, lookup: TensorLookup):
        super().__init__()
        moe = args.moe
        assert moe is not None, "a MoE layer in a model without experts"
        self.top_k, self.eps, self.hidden = moe.top_k, args.eps, args.hidden_size
        self.root = args.hidden_size ** -0.5
        self.router_scale = _const(lookup, names.name("moe.router_scale"))
        self.per_expert_scale = _const(lookup, names.name("moe.per_expert_scale"))
        self.router = PlaceholderLinear(names.name("moe.router"), args.hidden_size, moe.num_experts)
        experts = nn.ModuleList(Expert(names.names(EXPERT, expert=e), args.hidden_size, moe.width)
                                for e in range(moe.num_experts))
        self.experts = FusedMoE(experts, moe.top_k, index, args.hidden_size)

    def routing(self, x):
        h = rms_norm(x, None, self.eps) * self.router_scale * self.root
        probs = torch.softmax(self.router(h).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights * self.per_expert_scale[chosen]
        return weights, chosen

    def forward(self, routing_input, expert_input):
        weights, chosen = self.routing(routing_input.view(-1, self.hidden))
        out = self.experts(expert_input.view(-1, self.hidden), weights, chosen)
        return out.view(1, -1, self.hidden)


class DecoderLayer(nn.Module):
    def __init__(self, args: Gemma4TextArgs, names: NameTable, layer: LayerSpec, lookup: TensorLookup):
        super().__init__()
        p = names.bind(layer=layer.index)
        self.layer = layer
        norm = lambda key: Norm(_const(lookup, p.name(key)), args.eps)  # noqa: E731
        self.input_layernorm = norm("norm.input")
        self.post_attention_layernorm = norm("norm.post_attention")
        self.pre_feedforward_layernorm = norm("norm.pre_feedforward")
        self.post_feedforward_layernorm = norm("norm.post_feedforward")
        self.self_attn = Attention(args, p, layer, lookup)
        self.mlp = Mlp(p.names(MLP), args.hidden_size, layer.mlp_width)
        self.moe = MoE(args, p, layer.index, lookup) if args.moe else None
        if self.moe is not None:
            self.post_feedforward_layernorm_1, self.pre_feedforward_layernorm_2, self.post_feedforward_layernorm_2 = (
                norm(key) for key in MOE_NORMS)
        self.has_ple = args.ple_dim > 0
        if self.has_ple:
            self.per_layer_input_gate = PlaceholderLinear(p.name("ple.gate"), args.hidden_size, args.ple_dim)
            self.per_layer_projection = PlaceholderLinear(p.name("ple.projection"), args.ple_dim, args.hidden_size)
            self.post_per_layer_input_norm = norm("norm.post_ple")
        self.layer_scalar = _const(lookup, p.name("layer_scalar"))

    def forward(self, x, cos, sin, mask, ple, kv_store):
        residual = x
        x = self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_store)
        x = residual + self.post_attention_layernorm(x)
        residual = x
        x = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe is not None:
            moe_out = self.moe(residual, self.pre_feedforward_layernorm_2(residual))
            x = self.post_feedforward_layernorm_1(x) + self.post_feedforward_layernorm_2(moe_out)
        x = residual + self.post_feedforward_layernorm(x)
        if self.has_ple:
            gated = _act(self.per_layer_input_gate(x)) * ple
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar


class Gemma4TextGraph(nn.Module):
    """Inputs (runtime layout): input_ids = token-table rows [seq, 1, hidden (+ layers * ple_dim)]
    (unscaled: the embedding, then, with per-layer embeddings, the PLE row of the same token),
    attention_mask [2, 1, 1, seq, kv] (full, sliding) or [1, 1, seq, kv], position_ids int32
    [1, seq], logits_index int32 [1].
    Outputs: logits [1, n, vocab], hidden_states [1, n, hidden] (final-normed, sliced).

    The PLE rows ride in the token table rather than in MNN's separate ``ple_embeddings`` input:
    MNN 3.6.1 (and its current sources) refresh that input only when it is null or for one-token
    steps, and ``reset()`` keeps it (``Llm::embedding`` in transformers/llm/engine/src/llm.cpp),
    so a second multi-token forward (a chat's second turn) read a stale one. Rows of the token
    table are read afresh for every forward (mnn/token_table.py).
    With ``media_spans`` the input carries marked image soft tokens (media.py): they are
    unmarked, and each image run attends to itself both ways on sliding layers."""

    def __init__(self, args: Gemma4TextArgs, names: NameTable, lookup: TensorLookup, media_spans: bool = False):
        super().__init__()
        self.args = args
        self.layers = nn.ModuleList(DecoderLayer(args, names, layer, lookup) for layer in args.layers)
        self.norm = Norm(_const(lookup, names.name("norm.final")), args.eps)
        self.lm_head = PlaceholderLinear(names.name("lm_head"), args.hidden_size, args.vocab_size)
        register_ropes(self, args.rope)
        self.mixed = len(args.rope) > 1
        self.media_spans = media_spans
        if args.ple_dim:
            width = args.num_layers * args.ple_dim
            self.per_layer_model_projection = PlaceholderLinear(names.name("ple.model_projection"), args.hidden_size,
                                                                width)
            self.per_layer_projection_norm = Norm(_const(lookup, names.name("norm.ple_projection")), args.eps)

    def _per_layer_inputs(self, x, ple_rows):
        """HF ``project_per_layer_inputs``; ``ple_rows`` [seq, 1, layers * ple_dim] unscaled
        (HF ``get_per_layer_inputs`` multiplies the table by sqrt(ple_dim))."""
        a = self.args
        proj = self.per_layer_model_projection(x) * (a.hidden_size ** -0.5)
        proj = self.per_layer_projection_norm(proj.view(1, -1, a.num_layers, a.ple_dim))
        ple = ple_rows.view(1, -1, a.num_layers, a.ple_dim) * math.sqrt(a.ple_dim)
        return (proj + ple) * (2.0 ** -0.5)

    def forward(self, input_ids, attention_mask, position_ids, logits_index):
        a = self.args
        if self.media_spans:
            input_ids, marked = unmark_media(input_ids)
        if a.ple_dim:
            embeds, ple_rows = input_ids.split([a.hidden_size, a.num_layers * a.ple_dim], dim=-1)
        else:
            embeds, ple_rows = input_ids, None
        x = embeds.reshape(1, -1, a.hidden_size) * math.sqrt(a.hidden_size)
        ple = self._per_layer_inputs(x, ple_rows) if ple_rows is not None else None
        ropes = layer_ropes(self, position_ids, a.rope)
        masks = layer_masks(attention_mask, self.mixed)
        if self.media_spans and masks:  # without sliding layers HF's mask stays causal
            masks[SLIDING] = open_media_spans(masks[SLIDING], marked)
        ples = ple.unbind(2) if ple is not None else None
        kv_store: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, (layer, spec) in enumerate(zip(self.layers, a.layers)):
            kind = spec.kind
            cos, sin = ropes[kind]
            mask = masks[kind] if masks else attention_mask
            layer_ple = ples[i] if ples is not None else None
            x = layer(x, cos, sin, mask, layer_ple, kv_store)
        return head_outputs(x, logits_index, self.norm, self.lm_head, a.final_softcap)
