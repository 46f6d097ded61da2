"""Plain HF decoders in the Llama layout: what Llama, Qwen3 and Qwen3-MoE have in common.

Tensors (``N`` = layer, ``E`` = expert): ``model.embed_tokens.weight``, ``model.norm.weight``,
``lm_head.weight`` (absent when tied), ``model.layers.N.{input_layernorm,post_attention_layernorm}
.weight``, ``model.layers.N.self_attn.{q,k,v,o}_proj.weight`` (+ ``.bias`` with ``attention_bias``),
``self_attn.{q,k}_norm.weight`` [head_dim] for Qwen3, ``model.layers.N.mlp.{gate,up,down}_proj.weight``
on dense layers, and on sparse layers ``model.layers.N.mlp.gate.weight`` (router) plus
``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`` (the hub layout transformers saves).
A family file sets the transformers config class, whether q/k are normed, the RoPE types it
accepts and its end-of-turn tokens (docs/adding-a-family.md).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from llmexport.checkpoint import Checkpoint
from llmexport.models.decoder import DecoderFamily, Shapes, attention_specs, mlp_specs, pre_norm_shapes, routed_specs
from llmexport.models.decoder_args import DecoderArgs, parse_decoder_args, resolve_config
from llmexport.models.decoder_graph import DenseDecoderGraph, SwiGlu
from llmexport.models.tensor_checks import count_limit, finite_lookup
from llmexport.spec import ExpertTemplate, LinearRole, LinearSpec

_EXPERT_MARKER = "@expert@"


class PlainDecoder(DecoderFamily):
    #: name of the transformers config class that reads this family's config.json
    config_class: str = ""
    #: Qwen3: per-head RMSNorm of q and k (weights [head_dim]) before RoPE
    qk_norm: bool = False
    #: accepted ``rope_parameters.rope_type`` values
    rope_types: tuple[str, ...] = ("default",)
    #: tokens that close a chat turn (``Architecture.end_of_turn_tokens``)
    end_of_turn: tuple[str, ...] = ()

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        import transformers

        where = str(checkpoint.path / "config.json")
        config = resolve_config(getattr(transformers, self.config_class), checkpoint.config, where)
        self.args: DecoderArgs = parse_decoder_args(config, where, qk_norm=self.qk_norm, rope_types=self.rope_types,
                                                    max_count=count_limit(checkpoint.weights))
        self._linears = self._collect_linears()
        self.check_weights()

    # --- weights ----------------------------------------------------------------------------
    def _collect_linears(self) -> list[LinearSpec]:
        a = self.args
        h = a.hidden_size
        specs: list[LinearSpec] = []
        for layer in a.layers:
            p = f"model.layers.{layer.index}."
            specs += attention_specs(p + "self_attn.", h, a.num_heads * a.head_dim, a.kv_width, a.attention_bias)
            specs += routed_specs(p + "mlp.", h, a.moe.num_experts, a.moe.width) if a.moe and layer.sparse else \
                mlp_specs(p + "mlp.", h, a.intermediate_size, LinearRole.MLP)
        specs.append(LinearSpec("lm_head", h, a.vocab_size, LinearRole.LM_HEAD))
        return specs

    def linears(self) -> list[LinearSpec]:
        return list(self._linears)

    def constant_shapes(self) -> Shapes:
        a = self.args
        shapes: Shapes = {"model.norm.weight": (a.hidden_size,)}
        qk = (a.head_dim, a.head_dim) if a.qk_norm else None  # per-head norms
        for layer in a.layers:
            shapes.update(pre_norm_shapes(f"model.layers.{layer.index}.", a.hidden_size, qk))
        return shapes

    # --- graph ------------------------------------------------------------------------------
    def build_graph(self) -> nn.Module:
        return DenseDecoderGraph(self.args, finite_lookup(self.checkpoint.weights, self.checkpoint.path)).eval()

    def expert_templates(self) -> list[ExpertTemplate]:
        a = self.args
        sparse = [layer for layer in a.layers if layer.sparse]
        if not sparse or a.moe is None:
            return []
        instances = tuple((layer.index, e, f"model.layers.{layer.index}.mlp.experts.{e}")
                          for layer in sparse for e in range(a.moe.num_experts))
        return [ExpertTemplate(SwiGlu(_EXPERT_MARKER + ".", a.hidden_size, a.moe.width).eval(), _EXPERT_MARKER,
                               a.hidden_size, instances)]

    def describe(self) -> dict[str, Any]:
        a = self.args
        rope = "llama3" if a.rope.llama3 else "default"
        return {"family": self.family, "model_type": self.checkpoint.model_type, "layers": a.num_layers,
                "hidden_size": a.hidden_size, "vocab_size": a.vocab_size, "heads": a.num_heads,
                "kv_heads": a.kv_heads, "head_dim": a.head_dim, "rope": rope, "qk_norm": a.qk_norm,
                "moe": None if a.moe is None else vars(a.moe), "tied_embeddings": a.tie_embeddings,
                "layer_kinds": [f"{layer.index}: {'sparse: MoE' if layer.sparse else 'dense'}" for layer in a.layers]}

    # --- runtime files ----------------------------------------------------------------------
    def llm_config(self) -> dict[str, Any]:
        return self.full_attention_config(self.checkpoint.model_type)

    def runtime_config(self) -> dict[str, Any]:
        # fp32 activations, as for the other families: fp16 activations were not measured on a
        # CPU with fp16 arithmetic (docs/supported-models.md).
        return {"precision": "normal"}

    def end_of_turn_tokens(self) -> tuple[str, ...]:
        return self.end_of_turn
