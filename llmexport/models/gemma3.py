"""Gemma3 text family (``gemma3_text``, ``Gemma3ForCausalLM``: Gemma 3 270M and 1B).

Sliding and full layers with a RoPE table each, ``query_pre_attn_scalar``, four norms per layer
and q/k norms, Gemma's (1 + weight) RMSNorm, embeddings scaled by sqrt(hidden), tied embeddings
and optional final logit softcapping (gemma3_graph.py). The tensors are the Llama layout's plus
the feed-forward norms.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from llmexport.mnn.config import Precision
from llmexport.models.decoder.family import DecoderFamily
from llmexport.models.decoder.names import (
    LLAMA_LAYOUT,
    MLP,
    add_attention,
    add_mlp,
    layer_scale_groups,
    pre_norm_shapes,
)
from llmexport.models.gemma3_args import Gemma3Args, parse_gemma3_args
from llmexport.models.gemma3_graph import Gemma3TextGraph
from llmexport.models.layer_types import SLIDING, mix_config, mixed_graph_inputs
from llmexport.models.tensor_checks import Shapes, count_limit, finite_lookup
from llmexport.models.tensor_names import LinearList
from llmexport.source.checkpoint import Checkpoint
from llmexport.spec import ArchitectureSummary, GraphInputs, LinearRole, MlxLayout, NormFormula, ScaleGroup

NAMES = LLAMA_LAYOUT.extended({
    "norm.pre_feedforward": "model.layers.{layer}.pre_feedforward_layernorm.weight",
    "norm.post_feedforward": "model.layers.{layer}.post_feedforward_layernorm.weight",
})
FEEDFORWARD_NORMS = ("norm.pre_feedforward", "norm.post_feedforward")


class Gemma3(DecoderFamily):
    #: fp32 activations: real Gemma checkpoints overflow fp16 (docs/benchmarks.md, "fp16 on ARM")
    precision = Precision.NORMAL
    family = "Gemma3"
    names = NAMES

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        where = str(checkpoint.path / "config.json")
        self.args: Gemma3Args = parse_gemma3_args(checkpoint.config, where, max_layers=count_limit(checkpoint.weights))
        self._linears = self._collect_linears()
        self.check_weights()

    def _collect_linears(self) -> LinearList:
        a = self.args
        linears = LinearList(self.names)
        for layer in a.layers:
            add_attention(linears, layer.index, a.hidden_size, a.num_heads * a.head_dim, a.kv_width, a.attention_bias)
            add_mlp(linears, MLP, a.hidden_size, a.intermediate_size, LinearRole.MLP, layer=layer.index)
        self.add_head(linears)
        return linears

    def scale_groups(self) -> list[ScaleGroup]:
        a = self.args  # Gemma's RMSNorm multiplies by (1 + weight)
        return [group for layer in a.layers for group in layer_scale_groups(
            self.names, layer.index, ("norm.input", "norm.pre_feedforward"), ("attn.q", "attn.k", "attn.v"),
            a.num_heads // a.kv_heads, a.head_dim, NormFormula.OFFSET)]

    def constant_shapes(self) -> Shapes:
        a = self.args
        shapes: Shapes = {self.names.name("norm.final"): (a.hidden_size,)}
        for layer in a.layers:
            shapes.update(pre_norm_shapes(self.names, layer.index, a.hidden_size, (a.head_dim, a.head_dim)))
            shapes.update({name: (a.hidden_size,) for name in self.names.names(FEEDFORWARD_NORMS, layer=layer.index)})
        return shapes

    def build_graph(self) -> nn.Module:
        lookup = finite_lookup(self.checkpoint.weights, self.checkpoint.path)
        return Gemma3TextGraph(self.args, self.names, lookup).eval()

    def graph_inputs(self, seq_len: int) -> GraphInputs:
        return mixed_graph_inputs(seq_len, self.args.hidden_size, self.args.mixed)

    def describe(self) -> ArchitectureSummary:
        a = self.args
        layers = tuple(f"{layer.index}: {'sliding' if layer.kind == SLIDING else 'full'}" for layer in a.layers)
        details = {"heads": a.num_heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim,
                   "sliding_window": a.sliding_window, "attention_scale": a.scale,
                   "rope": {kind: [spec.theta, spec.factor] for kind, spec in a.rope.items()},  # JSON-ready
                   "final_softcap": a.final_softcap}
        return ArchitectureSummary(self.family, self.checkpoint.model_type, a.num_layers, a.hidden_size,
                                   a.vocab_size, a.tie_embeddings, layers, details)

    def llm_config(self) -> dict[str, Any]:
        config = self.full_attention_config("gemma3")
        return config | mix_config(self.args.rope, self.args.sliding_window) | {"attn_scale": self.args.scale}


    def end_of_turn_tokens(self) -> tuple[str, ...]:
        return ("<end_of_turn>",)

    @classmethod
    def mlx_layout(cls, config: dict[str, Any]) -> MlxLayout:
        """mlx-lm's port (mlx_lm/models/gemma3_text.py) keeps HF's names and norm weights (it adds
        the 1 itself); a tied head has no tensor there either."""
        return MlxLayout(())
