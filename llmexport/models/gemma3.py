"""Gemma3 family: text-only ``gemma3_text`` (``Gemma3ForCausalLM``: Gemma 3 270M and 1B) and
multimodal ``gemma3`` (``Gemma3ForConditionalGeneration``: 4B, 12B, 27B), whose text decoder is
the same one read from ``text_config`` under ``language_model.`` (the layout the released
checkpoints have and transformers 5 writes), and whose SigLIP tower is exported as
``visual.mnn`` (gemma3_vision.py).

Sliding and full layers with a RoPE table each, ``query_pre_attn_scalar``, four norms per layer
and q/k norms, Gemma's (1 + weight) RMSNorm, embeddings scaled by sqrt(hidden), tied embeddings
and optional final logit softcapping (gemma3_graph.py). The tensors are the Llama layout's plus
the feed-forward norms.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from llmexport.errors import InputError
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
from llmexport.models.gemma3_vision import Gemma3VisionTower
from llmexport.models.layer_types import SLIDING, mix_config, mixed_graph_inputs
from llmexport.models.tensor_checks import Shapes, count_limit, finite_lookup
from llmexport.models.tensor_names import LinearList
from llmexport.source.checkpoint import Checkpoint
from llmexport.spec import (
    ArchitectureSummary,
    GraphInputs,
    LinearRole,
    LinearSource,
    MlxLayout,
    NormFormula,
    ScaleGroup,
)

NAMES = LLAMA_LAYOUT.extended({
    "norm.pre_feedforward": "model.layers.{layer}.pre_feedforward_layernorm.weight",
    "norm.post_feedforward": "model.layers.{layer}.post_feedforward_layernorm.weight",
})
FEEDFORWARD_NORMS = ("norm.pre_feedforward", "norm.post_feedforward")
#: the multimodal checkpoint's names: the decoder under ``language_model.``
MULTIMODAL_NAMES = NAMES.moved("model.", "language_model.model.")
MULTIMODAL_HEAD = "language_model.lm_head.weight"  # an untied head (the graph's linear keeps the name lm_head)
#: stored name prefix -> the HF reference's parameter prefix (Gemma3ForConditionalGeneration)
_REFERENCE_PREFIXES = (("language_model.model.", "model.language_model."), ("language_model.lm_head", "lm_head"),
                       ("vision_tower.vision_model.", "model.vision_tower."), ("vision_tower.", "model.vision_tower."),
                       ("multi_modal_projector.", "model.multi_modal_projector."))


class Gemma3(DecoderFamily):
    #: fp32 activations: real Gemma checkpoints overflow fp16 (docs/benchmarks.md, "fp16 on ARM")
    precision = Precision.NORMAL
    family = "Gemma3"
    names = NAMES

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        where = str(checkpoint.path / "config.json")
        config = checkpoint.config
        self.multimodal = checkpoint.model_type == "gemma3"
        if self.multimodal:
            text = config.get("text_config")
            if not isinstance(text, dict):
                raise InputError(f"{where}: a 'gemma3' config needs a 'text_config' object")
            config = {**text, "tie_word_embeddings": config.get("tie_word_embeddings", True)}
            self.names = MULTIMODAL_NAMES
        self.args: Gemma3Args = parse_gemma3_args(config, where, max_layers=count_limit(checkpoint.weights))
        if self.multimodal and not self.args.mixed:
            raise InputError(f"{where}: a 'gemma3' checkpoint without sliding layers is not supported (its image "
                             "tokens attend both ways through the runtime's two-slice 'mix' mask)")
        self._linears = self._collect_linears()
        self._towers: list[Gemma3VisionTower] = self._build_towers()
        self.check_weights()

    def _build_towers(self) -> list[Gemma3VisionTower]:
        if not self.multimodal:
            return []
        vision = self.checkpoint.config.get("vision_config")
        if not isinstance(vision, dict):
            raise InputError(f"{self.checkpoint.path / 'config.json'}: a 'gemma3' config needs a 'vision_config' "
                             "object")
        return [Gemma3VisionTower(self, vision)]


    def reference_slot(self, tensor: str) -> tuple[str, tuple[Any, ...]]:
        if self.multimodal:
            for stored, reference in _REFERENCE_PREFIXES:
                if tensor.startswith(stored):
                    return reference + tensor[len(stored):], ()
        return tensor, ()

    def _collect_linears(self) -> LinearList:
        a = self.args
        linears = LinearList(self.names)
        for layer in a.layers:
            add_attention(linears, layer.index, a.hidden_size, a.num_heads * a.head_dim, a.kv_width, a.attention_bias)
            add_mlp(linears, MLP, a.hidden_size, a.intermediate_size, LinearRole.MLP, layer=layer.index)
        self.add_head(linears)
        return linears

    def add_head(self, linears: LinearList) -> None:
        if self.multimodal and not self.tied_embedding:
            linears.add("lm_head", self.args.hidden_size, self.args.vocab_size, LinearRole.LM_HEAD,
                        source=LinearSource(MULTIMODAL_HEAD))
        else:
            super().add_head(linears)

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
        return Gemma3TextGraph(self.args, self.names, lookup, media_spans=self.multimodal).eval()

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
