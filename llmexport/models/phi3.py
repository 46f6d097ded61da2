"""Phi-3 / Phi-3.5 / Phi-4-mini (``phi3``, ``Phi3ForCausalLM``).

The Llama layout with fused ``qkv_proj`` and ``gate_up_proj`` (kept fused: one placeholder each,
the graph splits the outputs), partial rotary (``partial_rotary_factor``: the first
``rotary_dim`` dims of a head rotate as a rotate-half pair set of their own, the rest pass) and
``longrope``. transformers picks the long factors when a forward's largest position + 1 exceeds
``original_max_position_embeddings`` and then recomputes the whole cache with them
(Phi3ForCausalLM.prepare_inputs_for_generation drops the cache at that point); MNN's KV cache
cannot re-rotate cached keys, so the exact export is the short factors (and the attention factor
on cos/sin) with the context capped at ``original_max_position_embeddings``. With
``sliding_window`` set every layer attends to that many last keys, the runtime's "mix" attention
with every layer on the sliding slice (as Mistral).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from llmexport.mnn.config import Precision
from llmexport.models.decoder.family import DecoderFamily
from llmexport.models.decoder.names import LAYER_NORMS, LLAMA_LAYOUT
from llmexport.models.phi3_args import Phi3Args, parse_phi3_args
from llmexport.models.phi3_graph import Phi3Graph
from llmexport.models.tensor_checks import Shapes, count_limit, finite_lookup
from llmexport.models.tensor_names import LinearList
from llmexport.source.checkpoint import Checkpoint
from llmexport.spec import ArchitectureSummary, LinearRole, MlxLayout

NAMES = LLAMA_LAYOUT.extended({
    "attn.qkv": "model.layers.{layer}.self_attn.qkv_proj",
    "mlp.gate_up": "model.layers.{layer}.mlp.gate_up_proj",
})


class Phi3(DecoderFamily):
    #: fp16 activations hold on MNN's ARM kernels (docs/benchmarks.md, "fp16 on ARM")
    precision = Precision.LOW
    family = "Phi3"
    names = NAMES

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        where = str(checkpoint.path / "config.json")
        self.args: Phi3Args = parse_phi3_args(checkpoint.config, where, max_layers=count_limit(checkpoint.weights))
        self._linears = self._collect_linears()
        self.check_weights()

    def _collect_linears(self) -> LinearList:
        a = self.args
        linears = LinearList(self.names)
        h, q = a.hidden_size, a.num_heads * a.head_dim
        for i in a.layers:
            linears.add("attn.qkv", h, q + 2 * a.kv_width, LinearRole.ATTENTION, layer=i)
            linears.add("attn.o", q, h, LinearRole.ATTENTION, layer=i)
            linears.add("mlp.gate_up", h, 2 * a.intermediate_size, LinearRole.MLP, layer=i)
            linears.add("mlp.down", a.intermediate_size, h, LinearRole.MLP, layer=i)
        self.add_head(linears)
        return linears

    def constant_shapes(self) -> Shapes:
        a = self.args
        shapes: Shapes = {self.names.name("norm.final"): (a.hidden_size,)}
        for i in a.layers:
            shapes.update({name: (a.hidden_size,) for name in self.names.names(LAYER_NORMS, layer=i)})
        return shapes

    def build_graph(self) -> nn.Module:
        return Phi3Graph(self.args, self.names, finite_lookup(self.checkpoint.weights, self.checkpoint.path)).eval()

    def describe(self) -> ArchitectureSummary:
        a = self.args
        return ArchitectureSummary(self.family, self.checkpoint.model_type, a.num_layers, a.hidden_size, a.vocab_size,
                                   a.tie_embeddings, tuple(f"{i}: dense" for i in a.layers),
                                   {"rotary_dim": a.rotary_dim, "attention_factor": a.attention_factor})

    @property
    def sliding_window(self) -> int:
        return self.args.sliding_window

    def llm_config(self) -> dict[str, Any]:
        return self.full_attention_config("phi3")


    def end_of_turn_tokens(self) -> tuple[str, ...]:
        return ("<|end|>",)

    @classmethod
    def mlx_layout(cls, config: dict[str, Any]) -> MlxLayout:
        """mlx-lm's port (mlx_lm/models/phi3.py) keeps HF's names, fused linears included."""
        return MlxLayout(())
