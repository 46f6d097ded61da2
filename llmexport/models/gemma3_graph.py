"""Trace-friendly Gemma3 text decoder (the graph MNN runs).

Mirrors transformers 5.x ``Gemma3TextModel`` / ``Gemma3DecoderLayer`` (modeling_gemma3.py):
embeddings times sqrt(hidden) (``Gemma3TextScaledWordEmbedding``; the runtime does the lookup,
unscaled), four RMSNorms per layer around attention and MLP, per-head q/k RMSNorms before RoPE,
each RMSNorm ``x * (1 + weight)`` in fp32 (``Gemma3RMSNorm``: the graph holds 1 + weight),
attention scaled by ``query_pre_attn_scalar ** -0.5``, sliding and full layers with their own
RoPE table and mask slice (layer_types.py, shared with Gemma4), the tanh-gelu MLP, optional final
logit softcapping. A multimodal checkpoint's image soft tokens come marked (gemma4/media.py):
they are unmarked and attend to their own image run both ways on every layer, as HF's
``create_causal_mask_mapping`` has it: OR(causal, same image) on full layers, AND(sliding window,
OR(causal, same image)) on sliding ones.
"""

from __future__ import annotations

import math

from torch import nn

from llmexport.models.decoder.graph import Attention
from llmexport.models.decoder.names import MLP
from llmexport.models.gemma3_args import Gemma3Args, LayerSpec
from llmexport.models.gemma4.graph import Mlp
from llmexport.models.gemma4.media import open_media_spans, unmark_media
from llmexport.models.graph_parts import Norm, TensorLookup, const, head_outputs
from llmexport.models.layer_types import layer_masks, layer_ropes, register_ropes
from llmexport.models.tensor_names import NameTable
from llmexport.trace.ops import PlaceholderLinear


def gemma_norm(lookup: TensorLookup, name: str, eps: float) -> Norm:
    """Gemma's RMSNorm: the stored weight is the offset from 1."""
    return Norm(const(lookup, name) + 1.0, eps)


class SandwichLayer(nn.Module):
    """``h = x + post_attention_norm(attn(input_norm(x)))``, then
    ``h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))`` (HF Gemma3DecoderLayer)."""

    def __init__(self, args: Gemma3Args, names: NameTable, layer: LayerSpec, lookup: TensorLookup):
        super().__init__()
        p = names.bind(layer=layer.index)
        norm = lambda key: gemma_norm(lookup, p.name(key), args.eps)  # noqa: E731
        self.input_layernorm = norm("norm.input")
        self.post_attention_layernorm = norm("norm.post_attention")
        self.pre_feedforward_layernorm = norm("norm.pre_feedforward")
        self.post_feedforward_layernorm = norm("norm.post_feedforward")
        self.self_attn = Attention(p, layer.index, args.hidden_size, args.num_heads, args.kv_heads, args.head_dim,
                                   args.attention_bias, (norm("norm.q"), norm("norm.k")), scale=args.scale)
        self.mlp = Mlp(p.names(MLP), args.hidden_size, args.intermediate_size)

    def forward(self, x, cos, sin, mask):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3TextGraph(nn.Module):
    """Inputs (runtime layout): input_ids = embeddings [seq, 1, hidden] (unscaled), attention_mask
    [2, 1, 1, seq, kv] (full, sliding) or [1, 1, seq, kv], position_ids int32 [1, seq],
    logits_index int32 [1]. Outputs: logits [1, n, vocab], hidden_states [1, n, hidden].
    ``media_spans``: the input may carry marked image soft tokens (needs the two-slice mask)."""

    def __init__(self, args: Gemma3Args, names: NameTable, lookup: TensorLookup, media_spans: bool = False):
        super().__init__()
        self.args, self.media_spans = args, media_spans
        self.layers = nn.ModuleList(SandwichLayer(args, names, layer, lookup) for layer in args.layers)
        self.norm = gemma_norm(lookup, names.name("norm.final"), args.eps)
        self.lm_head = PlaceholderLinear(names.name("lm_head"), args.hidden_size, args.vocab_size)
        register_ropes(self, args.rope)

    def forward(self, input_ids, attention_mask, position_ids, logits_index):
        a = self.args
        if self.media_spans:
            input_ids, marked = unmark_media(input_ids)
        x = input_ids.reshape(1, -1, a.hidden_size) * math.sqrt(a.hidden_size)
        ropes = layer_ropes(self, position_ids, a.rope)
        masks = layer_masks(attention_mask, a.mixed)
        if self.media_spans and masks:
            masks = {kind: open_media_spans(mask, marked) for kind, mask in masks.items()}
        for layer, spec in zip(self.layers, a.layers):
            cos, sin = ropes[spec.kind]
            x = layer(x, cos, sin, masks[spec.kind] if masks else attention_mask)
        return head_outputs(x, logits_index, self.norm, self.lm_head, a.final_softcap)
