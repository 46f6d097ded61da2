"""Plain HF decoders in the Llama layout: what Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral and SmolLM3 share.

Tensors: the table ``decoder_names.LLAMA_LAYOUT`` (``lm_head.weight`` absent when tied, biases of
the attention projections with ``attention_bias`` or the family's fixed set, the q/k norms
[head_dim] with ``qk_norm``, routers and per-expert MLPs on sparse layers, as the hub saves them).
A family file sets the transformers config class, whether q/k are normed, which projections
carry biases, how its sliding layers are chosen, whether some layers skip RoPE, the RoPE types
it accepts, its end-of-turn tokens and, if its names differ, its own table
(docs/adding-a-family.md).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from llmexport.models.decoder.args import NO_SLIDING, DecoderArgs, parse_decoder_args, resolve_config
from llmexport.models.decoder.family import DecoderFamily
from llmexport.models.decoder.graph import DenseDecoderGraph, swiglu_expert_templates
from llmexport.models.decoder.names import (
    LLAMA_LAYOUT,
    MLP,
    ROUTED_EXPERTS,
    add_attention,
    add_mlp,
    add_routed,
    layer_scale_groups,
    pre_norm_shapes,
)
from llmexport.models.tensor_checks import Shapes, count_limit, finite_lookup
from llmexport.models.tensor_names import LinearList
from llmexport.source.checkpoint import Checkpoint
from llmexport.spec import ArchitectureSummary, ExpertTemplate, LinearRole, MlxLayout, ScaleGroup


class PlainDecoder(DecoderFamily):
    names = LLAMA_LAYOUT
    #: name of the transformers config class that reads this family's config.json
    config_class: str = ""
    #: Qwen3: per-head RMSNorm of q and k (weights [head_dim]) before RoPE
    qk_norm: bool = False
    #: the attention projections with a bias whatever the config says (Qwen2: q, k, v); None:
    #: all four with ``attention_bias``
    attention_biases: tuple[str, ...] | None = None
    #: how the reference picks sliding layers (decoder_args: NO_SLIDING refuses sliding configs)
    sliding: str = NO_SLIDING
    #: SmolLM3: layers without RoPE, listed in ``no_rope_layers``
    no_rope: bool = False
    #: mlx-lm ports the family under HF's own tensor names (mlx_lm/models/qwen2.py, smollm3.py;
    #: mistral runs as llama.py): its MLX-quantized checkpoints are read as they are
    mlx_port: bool = False
    #: accepted ``rope_parameters.rope_type`` values
    rope_types: tuple[str, ...] = ("default",)
    #: tokens that close a chat turn (``Architecture.end_of_turn_tokens``)
    end_of_turn: tuple[str, ...] = ()
    #: the routed experts are rows of stacked tensors (``STACKED_EXPERT``: a fused gate_up and down
    #: each), not one module per expert
    stacked_experts: bool = False

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        import transformers

        where = str(checkpoint.path / "config.json")
        config = resolve_config(getattr(transformers, self.config_class), self.text_config(checkpoint.config, where),
                                where)
        self.args: DecoderArgs = parse_decoder_args(config, where, qk_norm=self.qk_norm, rope_types=self.rope_types,
                                                    max_count=count_limit(checkpoint.weights), sliding=self.sliding,
                                                    biases=self.attention_biases, no_rope=self.no_rope)
        self._linears = self._collect_linears()
        self._towers = self.build_towers()
        self.check_weights()

    def text_config(self, raw: dict[str, Any], where: str) -> dict[str, Any]:
        """The decoder's config in config.json (``raw``): all of it here; a multimodal family's
        ``text_config``."""
        return raw

    def build_towers(self) -> list[Any]:
        """The towers exported beside the text graph (``self.args`` is parsed): none here."""
        return []

    @classmethod
    def mlx_layout(cls, config: dict[str, Any]) -> MlxLayout | None:
        return MlxLayout() if cls.mlx_port else None

    # --- weights ----------------------------------------------------------------------------
    def _collect_linears(self) -> LinearList:
        a = self.args
        h = a.hidden_size
        linears = LinearList(self.names)
        for layer in a.layers:
            add_attention(linears, layer.index, h, a.num_heads * a.head_dim, a.kv_width, a.biases)
            if a.moe and layer.sparse:
                add_routed(linears, layer.index, h, a.moe.num_experts, a.moe.width, self.stacked_experts)
            else:
                add_mlp(linears, MLP, h, a.intermediate_size, LinearRole.MLP, layer=layer.index)
        self.add_head(linears)
        return linears

    def scale_groups(self) -> list[ScaleGroup]:
        a = self.args
        return [group for layer in a.layers for group in layer_scale_groups(
            self.names, layer.index, ("norm.input", "norm.post_attention"), ("attn.q", "attn.k", "attn.v"),
            a.num_heads // a.kv_heads, a.head_dim, mlp_skip=ROUTED_EXPERTS if a.moe and layer.sparse else None)]

    @property
    def sliding_window(self) -> int:
        return self.args.sliding_window

    def constant_shapes(self) -> Shapes:
        a = self.args
        shapes: Shapes = {self.names.name("norm.final"): (a.hidden_size,)}
        qk = (a.head_dim, a.head_dim) if a.qk_norm else None  # per-head norms
        for layer in a.layers:
            shapes.update(pre_norm_shapes(self.names, layer.index, a.hidden_size, qk))
        return shapes

    # --- graph ------------------------------------------------------------------------------
    def build_graph(self) -> nn.Module:
        lookup = finite_lookup(self.checkpoint.weights, self.checkpoint.path)
        return DenseDecoderGraph(self.args, self.names, lookup, self.stacked_experts).eval()

    def expert_templates(self) -> list[ExpertTemplate]:
        a = self.args
        if a.moe is None:
            return []
        return swiglu_expert_templates(self.names, a.hidden_size, a.moe.width,
                                       [layer.index for layer in a.layers if layer.sparse], a.moe.num_experts,
                                       self.stacked_experts)

    def stacked_count(self, tensor: str) -> int:
        if self.args.moe is None or not self.stacked_experts:
            return super().stacked_count(tensor)
        return self.args.moe.num_experts

    def describe(self) -> ArchitectureSummary:
        a = self.args
        rope = "llama3" if a.rope.llama3 else "default"
        details = {"heads": a.num_heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim, "rope": rope,
                   "qk_norm": a.qk_norm, "moe": None if a.moe is None else vars(a.moe)}
        if a.sliding_window:
            details["sliding_window"] = a.sliding_window
        return ArchitectureSummary(
            self.family, self.checkpoint.model_type, a.num_layers, a.hidden_size, a.vocab_size, a.tie_embeddings,
            tuple(f"{layer.index}: {'sparse: MoE' if layer.sparse else 'dense'}{', sliding' if layer.sliding else ''}"
                  f"{'' if layer.rope else ', no RoPE'}"
                  for layer in a.layers), details)

    # --- runtime files ----------------------------------------------------------------------
    def llm_config(self) -> dict[str, Any]:
        return self.full_attention_config(self.checkpoint.model_type)


    def end_of_turn_tokens(self) -> tuple[str, ...]:
        return self.end_of_turn
