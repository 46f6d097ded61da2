"""LFM2 family (Liquid AI): dense ``lfm2`` (``Lfm2ForCausalLM``) and sparse ``lfm2_moe``
(``Lfm2MoeForCausalLM``).

Gated short-conv layers (MNN's LinearAttention op, ``short_conv``) interleaved with GQA
attention layers (q/k RMSNorm per head, default RoPE), SwiGLU MLPs (``feed_forward`` w1/w3/w2),
the final norm ``embedding_norm``, tied embeddings by default. LFM2-MoE keeps its first
``num_dense_layers`` dense and routes the others over SwiGLU experts (sigmoid router, selection-only
``expert_bias``). The conv's state lives in the runtime like the KV cache; the graph's recurrent
layers take no mask, so llm_config.json declares full attention. The checkpoint keeps one tensor
per expert, transformers stacks them (``reference_slot``). The reference is transformers' own class.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from llmexport.mnn.config import Precision
from llmexport.models.decoder.family import DecoderFamily
from llmexport.models.decoder.graph import swiglu_expert_templates
from llmexport.models.decoder.names import (
    LAYER_NORMS,
    MLP,
    QK_NORMS,
    ROUTED_EXPERTS,
    add_attention,
    add_mlp,
    add_routed,
    layer_scale_groups,
    stacked_expert_slot,
)
from llmexport.models.lfm2.args import Lfm2Args, parse_args
from llmexport.models.lfm2.chat_template import lfm2_jinja
from llmexport.models.lfm2.graph import Lfm2Graph
from llmexport.models.lfm2.names import LFM2_NAMES, MLX_CONV, MLX_RENAMED
from llmexport.models.tensor_checks import Shapes, count_limit, finite_lookup
from llmexport.models.tensor_names import LinearList, rename_rule, weight_name
from llmexport.source.checkpoint import Checkpoint
from llmexport.spec import ArchitectureSummary, ExpertTemplate, LinearRole, MlxLayout, ScaleGroup


class Lfm2(DecoderFamily):
    #: fp16 activations hold on MNN's ARM kernels (docs/benchmarks.md, "fp16 on ARM")
    precision = Precision.LOW
    family = "LFM2"
    names = LFM2_NAMES
    #: name of the transformers config class that reads this family's config.json
    config_class = "Lfm2Config"
    moe = False

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        import transformers

        self.args: Lfm2Args = parse_args(getattr(transformers, self.config_class), checkpoint.config,
                                         str(checkpoint.path / "config.json"), self.moe,
                                         count_limit(checkpoint.weights))
        self._linears = self._collect_linears()
        self.check_weights()

    # --- weights ----------------------------------------------------------------------------
    def _collect_linears(self) -> LinearList:
        a = self.args
        h = a.hidden_size
        linears = LinearList(self.names)
        for layer in a.layers:
            if layer.attention:
                add_attention(linears, layer.index, h, a.num_heads * a.head_dim, a.kv_width, False)
            else:
                linears.add("conv.in", h, 3 * h, LinearRole.ATTENTION, layer=layer.index)
                linears.add("conv.out", h, h, LinearRole.ATTENTION, layer=layer.index)
            if layer.sparse and a.moe is not None:
                add_routed(linears, layer.index, h, a.moe.num_experts, a.moe_width)
            else:
                add_mlp(linears, MLP, h, a.intermediate_size, LinearRole.MLP, layer=layer.index)
        self.add_head(linears)
        return linears

    def scale_groups(self) -> list[ScaleGroup]:
        """operator_norm before q/k/v or the conv's in_proj, ffn_norm before w1/w3, v before
        out_proj, w3 before w2 (plain RMSNorms, ``x * w``). The conv's out_proj reads
        ``C * conv(B * x)``: its input channels come from one third of in_proj's rows, which is no
        whole producer linear, so it is left alone; norms feeding routed experts are skipped."""
        a = self.args
        return [group for layer in a.layers for group in layer_scale_groups(
            self.names, layer.index, ("norm.input", "norm.post_attention"),
            ("attn.q", "attn.k", "attn.v") if layer.attention else ("conv.in",),
            a.num_heads // a.kv_heads, a.head_dim, mlp_skip=ROUTED_EXPERTS if layer.sparse else None)]

    def constant_shapes(self) -> Shapes:
        """Norm gammas, conv kernels and the routers' selection biases: graph constants."""
        a, names = self.args, self.names
        shapes: Shapes = {names.name("norm.final"): (a.hidden_size,)}
        for layer in a.layers:
            p = names.bind(layer=layer.index)
            shapes.update({name: (a.hidden_size,) for name in p.names(LAYER_NORMS)})
            if layer.attention:
                shapes.update({name: (a.head_dim,) for name in p.names(QK_NORMS)})
            else:
                shapes[p.name("conv.weight")] = (a.hidden_size, 1, a.conv_kernel)
            if layer.sparse and a.moe is not None and a.expert_bias:
                shapes[p.name("moe.router.bias")] = (a.moe.num_experts,)
        return shapes

    # --- graph ------------------------------------------------------------------------------
    def build_graph(self) -> nn.Module:
        lookup = finite_lookup(self.checkpoint.weights, self.checkpoint.path)
        return Lfm2Graph(self.args, self.names, lookup).eval()

    def expert_templates(self) -> list[ExpertTemplate]:
        a = self.args
        if a.moe is None:
            return []
        return swiglu_expert_templates(self.names, a.hidden_size, a.moe_width,
                                       [layer.index for layer in a.layers if layer.sparse], a.moe.num_experts)

    def describe(self) -> ArchitectureSummary:
        a = self.args
        kinds = tuple(f"{layer.index}: {'attention' if layer.attention else 'short conv'}"
                      f"{', sparse: MoE' if layer.sparse else ''}" for layer in a.layers)
        details = {"heads": a.num_heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim,
                   "conv_kernel": a.conv_kernel, "moe": None if a.moe is None else
                   dict(vars(a.moe), width=a.moe_width, expert_bias=a.expert_bias)}
        return ArchitectureSummary(self.family, self.checkpoint.model_type, a.num_layers, a.hidden_size,
                                   a.vocab_size, a.tie_embeddings, kinds, details)

    # --- runtime files ----------------------------------------------------------------------
    def llm_config(self) -> dict[str, Any]:
        return self.full_attention_config(self.checkpoint.model_type)

    def runtime_chat_template(self) -> dict[str, Any] | None:
        """LiquidAI's released templates in the form MNN's runtime renders as transformers does
        (models/lfm2/chat_template.py); another template passes through with the runtime's known
        differences logged."""
        return lfm2_jinja(self.checkpoint_chat_template())


    def end_of_turn_tokens(self) -> tuple[str, ...]:
        return ("<|im_end|>",)

    # --- MLX checkpoints (llmexport/source/importers/mlx) ------------------------------------------------
    @classmethod
    def mlx_layout(cls, config: dict[str, Any]) -> MlxLayout:
        """mlx-lm's port (names.py ``MLX_CONV``, ``MLX_RENAMED``): the conv kernel's axes swapped
        back, the renamed MLPs, each stacked expert tensor split into its experts' weights."""
        names = LFM2_NAMES
        renamed = [rename_rule(mlx, weight_name(names.pattern(key)), split="expert" if split else None)
                   for mlx, (key, split) in MLX_RENAMED.items()]
        return MlxLayout((rename_rule(MLX_CONV, names.pattern("conv.weight"), transpose=True), *renamed))

    # --- reference --------------------------------------------------------------------------
    def reference_slot(self, tensor: str) -> tuple[str, tuple[Any, ...]]:
        """LFM2-MoE: an expert's w1/w3 rows of transformers' stacked ``gate_up_proj``
        [E, 2 * width, hidden] (Lfm2MoeExperts: w1 first), or its ``w2`` in ``down_proj``."""
        slot = stacked_expert_slot(self.names, tensor, self.args.moe_width) if self.args.moe else None
        return slot if slot is not None else super().reference_slot(tensor)


class Lfm2Moe(Lfm2):
    #: fp32 activations: fp16 flips router choices on MNN's ARM kernels (docs/benchmarks.md, "fp16 on ARM")
    precision = Precision.NORMAL
    family = "LFM2-MoE"
    config_class = "Lfm2MoeConfig"
    moe = True
