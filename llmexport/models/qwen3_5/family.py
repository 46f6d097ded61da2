"""Qwen3.5 family: ``qwen3_5`` / ``qwen3_5_moe`` (the released multimodal checkpoints,
Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration: the text side, and the
vision tower where the checkpoint has one, as ``visual.mnn`` (qwen_vl/vision.py, towers.py), the
text graph then taking the runtime's M-RoPE positions, qwen_vl/mrope.py) and ``qwen3_5_text`` /
``qwen3_5_moe_text`` (what AutoModelForCausalLM saves: Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM).

Gated DeltaNet layers run on MNN's LinearAttention op, which keeps their conv and recurrent state
between calls as the Attention op keeps its KV cache; gated full-attention layers on the Attention
op; routed experts on the MoE op. The graph is in qwen3_5/graph.py. The reference is
transformers' model of the checkpoint's layout in fp32 (the conditional-generation class, or
AutoModelForCausalLM). Checkpoints keep the routed experts one tensor per expert (what
transformers' save_pretrained writes; the reference stacks them, ``reference_slot``) or stacked as
transformers keeps them in memory (``gate_up_proj`` [E, 2 * width, hidden], ``down_proj``
[E, hidden, width]; each expert reads its row, the reference takes them as they are):
``stacked_experts`` tells which from the tensors the checkpoint has.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmexport.errors import InputError
from llmexport.mnn.config import Precision
from llmexport.models.decoder.family import DecoderFamily, expert_template
from llmexport.models.decoder.graph import routed_expert
from llmexport.models.decoder.names import (
    EXPERT_MLP,
    MLP,
    ROUTED_EXPERTS,
    add_mlp,
    add_routed,
    expert_linears,
    layer_scale_groups,
    pre_norm_shapes,
    stacked_expert_slot,
)
from llmexport.models.qwen3_5.args import Qwen3_5Args, parse_args
from llmexport.models.qwen3_5.chat_template import qwen3_5_jinja
from llmexport.models.qwen3_5.graph import Qwen3_5Graph
from llmexport.models.qwen3_5.names import (
    DELTA_CONSTANTS,
    MLX_EXPERTS,
    MLX_HEAD,
    MLX_OFFSET_NORMS,
    MLX_TEXT_PREFIX,
    MLX_TRANSPOSED,
    MULTIMODAL_PREFIX,
    QWEN3_5_NAMES,
    QWEN3_5_STACKED,
    SHARED_MLP,
    TEXT_PREFIX,
    VISION_PREFIX,
)
from llmexport.models.qwen_vl.towers import QwenVisionTower
from llmexport.models.tensor_checks import Shapes, count_limit, finite_lookup
from llmexport.models.tensor_names import LinearList, NameTable, match, prefix_rule, rename_rule, weight_name
from llmexport.source.checkpoint import Checkpoint
from llmexport.spec import (
    ArchitectureSummary,
    ExpertTemplate,
    GraphInputs,
    LinearRole,
    MlxLayout,
    NormFormula,
    ScaleGroup,
)

#: checkpoint tensors the export does not read: the multi-token-prediction head the released
#: checkpoints ship (Qwen3_5ForCausalLM ignores ``mtp.*`` on load too)
_NOT_READ = ("mtp.",)


def stacked_experts(names: NameTable, weights: Any, where: Any) -> bool:
    """Whether the checkpoint stores its routed experts stacked (``gate_up_proj`` / ``down_proj``
    of ``names``' ``reference.experts.*``) rather than one tensor per expert (``EXPERT_MLP``); a
    checkpoint with both is an InputError naming one of each. An incomplete layout is left to
    the tensor check, which names the first tensor missing."""
    stacked = [names.pattern(key) for key in ("reference.experts.gate_up", "reference.experts.down")]
    per_expert = [weight_name(names.pattern(key)) for key in EXPERT_MLP]
    found_stacked = next((n for n in weights.names() if any(match(p, n) is not None for p in stacked)), None)
    found_single = next((n for n in weights.names() if any(match(p, n) is not None for p in per_expert)), None)
    if found_stacked is not None and found_single is not None:
        raise InputError(f"{where}: routed experts stored both stacked ({found_stacked!r}) and one tensor per "
                         f"expert ({found_single!r}); a checkpoint keeps one layout")
    return found_stacked is not None


class Qwen3_5(DecoderFamily):
    #: fp16 activations hold on MNN's ARM kernels (docs/benchmarks.md, "fp16 on ARM")
    precision = Precision.LOW
    family = "Qwen3.5"
    #: transformers' text config class (reads config.json or its ``text_config``)
    config_class = "Qwen3_5TextConfig"
    #: the reference's class for the multimodal layout
    multimodal_class = "Qwen3_5ForConditionalGeneration"
    multimodal = True
    moe = False
    ignored_suffixes = ("rotary_emb.inv_freq",)

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        import transformers

        prefix = MULTIMODAL_PREFIX if self.multimodal else TEXT_PREFIX
        where = checkpoint.path
        #: the routed experts stored stacked (one row each of gate_up_proj / down_proj)
        self.stacked = self.moe and stacked_experts(QWEN3_5_NAMES.bind(prefix=prefix), checkpoint.weights, where)
        self.names = (QWEN3_5_STACKED if self.stacked else QWEN3_5_NAMES).bind(prefix=prefix)
        self.args: Qwen3_5Args = parse_args(checkpoint.config, getattr(transformers, self.config_class),
                                            str(checkpoint.path / "config.json"), multimodal=self.multimodal,
                                            moe=self.moe, max_count=count_limit(checkpoint.weights))
        self._linears = self._collect_linears()
        self._towers = self._build_towers()
        self.check_weights()

    def _build_towers(self) -> list[QwenVisionTower]:
        """The vision tower of a multimodal checkpoint that has its tensors (mlx-lm's port drops
        them and the vision config)."""
        if not self.multimodal or not any(n.startswith(VISION_PREFIX) for n in self.checkpoint.weights.names()):
            return []
        vision = self.checkpoint.config.get("vision_config")
        if not isinstance(vision, dict):
            raise InputError(f"{self.checkpoint.path / 'config.json'}: the checkpoint has {VISION_PREFIX}* tensors "
                             "but no 'vision_config' object")
        return [QwenVisionTower(self, vision)]


    def ignored_tensor(self, name: str) -> bool:
        return name.startswith(_NOT_READ) or super().ignored_tensor(name)

    # --- weights ----------------------------------------------------------------------------
    def _collect_linears(self) -> LinearList:
        a = self.args
        h, s = a.hidden_size, a.delta
        linears = LinearList(self.names)
        for layer in a.layers:
            i = layer.index
            if layer.linear:
                for key, width in (("delta.qkv", s.channels), ("delta.z", s.value_width), ("delta.b", s.v_heads),
                                   ("delta.a", s.v_heads)):
                    linears.add(key, h, width, LinearRole.ATTENTION, layer=i)
                linears.add("delta.out", s.value_width, h, LinearRole.ATTENTION, layer=i)
            else:
                q_width = a.num_heads * a.head_dim
                linears.add("attn.q", h, 2 * q_width, LinearRole.ATTENTION, layer=i)
                linears.add("attn.k", h, a.kv_width, LinearRole.ATTENTION, layer=i)
                linears.add("attn.v", h, a.kv_width, LinearRole.ATTENTION, layer=i)
                linears.add("attn.o", q_width, h, LinearRole.ATTENTION, layer=i)
            if a.moe is None:
                add_mlp(linears, MLP, h, a.intermediate_size, LinearRole.MLP, layer=i)
            else:
                self._add_routed(linears, i)
                add_mlp(linears, SHARED_MLP, h, a.moe.shared_width, LinearRole.MLP, layer=i)
                linears.add("shared.router", h, 1, LinearRole.ROUTER, layer=i)
        self.add_head(linears)
        return linears

    def _add_routed(self, linears: LinearList, layer: int) -> None:
        """The router and the routed experts: gate, up and down each, or a fused gate_up and down
        (a row of the stacked tensors) where the checkpoint stores them stacked."""
        a = self.args
        assert a.moe is not None, "routed experts in a dense model"
        add_routed(linears, layer, a.hidden_size, a.moe.num_experts, a.moe.width, self.stacked)

    def scale_groups(self) -> list[ScaleGroup]:
        """input_layernorm before q/k/v or the DeltaNet's four input projections, the MLP norm before
        gate/up, v before o (the output gate multiplies each channel, so a scale passes through it),
        up before down; Qwen3.5's RMSNorms multiply by ``1 + w``. The DeltaNet's out_proj reads the
        gated norm of the recurrence (not linear in its inputs) and is left alone; the sparse
        block's norm feeds the routed experts and is skipped."""
        a = self.args
        return [group for layer in a.layers for group in layer_scale_groups(
            self.names, layer.index, ("norm.input", "norm.post_attention"),
            ("delta.qkv", "delta.z", "delta.b", "delta.a") if layer.linear else ("attn.q", "attn.k", "attn.v"),
            a.num_heads // a.kv_heads, a.head_dim, NormFormula.OFFSET,
            mlp_skip=ROUTED_EXPERTS if a.moe is not None else None)]

    def constant_shapes(self) -> Shapes:
        """Norm gammas, the DeltaNet conv kernels and 1-D constants (A_log, dt_bias)."""
        a, names, s = self.args, self.names, self.args.delta
        shapes: Shapes = {names.name("norm.final"): (a.hidden_size,)}
        for layer in a.layers:
            i = layer.index
            if layer.linear:
                shapes.update(pre_norm_shapes(names, i, a.hidden_size, None))
                shapes[names.name("delta.conv", layer=i)] = (s.channels, 1, s.kernel)
                shapes.update({names.name(key, layer=i): (s.v_heads,) for key in DELTA_CONSTANTS})
                shapes[names.name("delta.norm", layer=i)] = (s.v_dim,)
            else:
                shapes.update(pre_norm_shapes(names, i, a.hidden_size, (a.head_dim, a.head_dim)))
        return shapes

    # --- graph ------------------------------------------------------------------------------
    def build_graph(self) -> nn.Module:
        lookup = finite_lookup(self.checkpoint.weights, self.checkpoint.path)
        return Qwen3_5Graph(self.args, self.names, lookup, self.stacked, mrope=bool(self._towers)).eval()

    def graph_inputs(self, seq_len: int) -> GraphInputs:
        """The standard inputs; with the vision tower ``position_ids`` are the runtime's three
        M-RoPE rows [3, seq] (the runtime reads the graph's input shape, omni.cpp ``gen_position_ids``)."""
        inputs = super().graph_inputs(seq_len)
        if not self._towers:
            return inputs
        args = list(inputs.args)
        args[2] = torch.arange(seq_len, dtype=torch.int32).view(1, -1).repeat(3, 1)
        return GraphInputs(tuple(args), inputs.names, inputs.dynamic_axes, inputs.output_names)

    def expert_templates(self) -> list[ExpertTemplate]:
        a = self.args
        if a.moe is None:
            return []
        return [expert_template(self.names, "moe.expert", expert_linears(self.stacked),
                                routed_expert(a.hidden_size, a.moe.width, self.stacked), a.hidden_size,
                                ((layer.index, layer.index, e) for layer in a.layers
                                 for e in range(a.moe.num_experts)))]

    def stacked_count(self, tensor: str) -> int:
        if self.args.moe is None:
            raise NotImplementedError("a dense Qwen3.5 stacks no experts")
        return self.args.moe.num_experts

    def describe(self) -> ArchitectureSummary:
        a = self.args
        kinds = tuple(f"{layer.index}: {'gated deltanet' if layer.linear else 'gated attention'}"
                      f"{', MoE' if a.moe else ''}" for layer in a.layers)
        details = {"heads": a.num_heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim, "rotary_dim": a.rotary_dim,
                   "linear_attention": vars(a.delta), "moe": None if a.moe is None else vars(a.moe)}
        return ArchitectureSummary(self.family, self.checkpoint.model_type, a.num_layers, a.hidden_size, a.vocab_size,
                                   a.tie_embeddings, kinds, details)

    # --- runtime files ----------------------------------------------------------------------
    def llm_config(self) -> dict[str, Any]:
        # "full": the Attention layers take the causal mask, the LinearAttention layers no mask;
        # text positions need no M-RoPE (no is_mrope key, see graph.py); with the vision tower
        # the runtime feeds its three rows
        config = self.full_attention_config(self.checkpoint.model_type)
        return config | {"is_mrope": True} if self._towers else config

    def runtime_chat_template(self) -> dict[str, Any] | None:
        """Qwen3.5's real template in the form MNN's runtime renders as transformers does
        (models/qwen3_5/chat_template.py); another template passes through with the runtime's
        known differences logged."""
        return qwen3_5_jinja(self.checkpoint_chat_template())


    def end_of_turn_tokens(self) -> tuple[str, ...]:
        return ("<|im_end|>",)

    # --- MLX checkpoints (llmexport/source/importers/mlx) ------------------------------------------------
    @classmethod
    def mlx_layout(cls, config: dict[str, Any]) -> MlxLayout | None:
        """mlx-lm's port of the multimodal types (names.py ``MLX_*``): the text model under
        ``language_model.``, the ``1 + w`` norm gammas and the conv kernels mapped back to HF's
        values and shapes, each stacked expert tensor split into its experts' weights. mlx-lm 0.32
        has no port of the text-only types (docs/mlx-import.md)."""
        if not cls.multimodal:
            return None
        hf = QWEN3_5_NAMES.bind(prefix=MULTIMODAL_PREFIX)
        mlx = QWEN3_5_NAMES.bind(prefix=MLX_TEXT_PREFIX)
        experts = MLX_EXPERTS.bind(prefix=MLX_TEXT_PREFIX)
        return MlxLayout((
            *(rename_rule(mlx.pattern(key), hf.pattern(key), offset=1.0) for key in MLX_OFFSET_NORMS),
            rename_rule(mlx.pattern(MLX_TRANSPOSED), hf.pattern(MLX_TRANSPOSED), transpose=True),
            *(rename_rule(experts.pattern(key), weight_name(hf.pattern(key)), split="expert")
              for key in MLX_EXPERTS.patterns),
            prefix_rule(MLX_TEXT_PREFIX + ".", MULTIMODAL_PREFIX + "."),
            prefix_rule(MLX_HEAD + ".", hf.name("lm_head") + "."),
        ))

    # --- reference --------------------------------------------------------------------------
    def reference_loader(self) -> Any:
        """The checkpoint's own class: for the multimodal layout the conditional-generation model,
        whose tensor names are the checkpoint's (its tower never runs on text prompts)."""
        if not self.multimodal:
            return super().reference_loader()
        import transformers

        return getattr(transformers, self.multimodal_class)

    def empty_reference(self, trust_remote_code: bool = False) -> nn.Module:
        """The reference on the meta device; where the checkpoint has no tower (mlx-lm's port drops
        it and its config, so transformers would build its default one), the tower is left out:
        it never runs on text prompts and has nothing to be filled from."""
        model = super().empty_reference(trust_remote_code)
        if self.multimodal and not any(n.startswith(VISION_PREFIX) for n in self.checkpoint.weights.names()):
            model.get_submodule("model").visual = nn.Module()
        return model

    def reference_slot(self, tensor: str) -> tuple[str, tuple[Any, ...]]:
        """An expert's rows of transformers' stacked ``gate_up_proj`` / ``down_proj``
        (decoder/names.py ``stacked_expert_slot``); every other tensor, the stacked experts of a
        stacked checkpoint included, where the checkpoint has it."""
        slot = stacked_expert_slot(self.names, tensor, self.args.moe.width) if self.args.moe else None
        return slot if slot is not None else (tensor, ())


class Qwen3_5Moe(Qwen3_5):
    #: fp32 activations: fp16 flips router choices on MNN's ARM kernels (docs/benchmarks.md, "fp16 on ARM")
    precision = Precision.NORMAL
    family = "Qwen3.5-MoE"
    config_class = "Qwen3_5MoeTextConfig"
    multimodal_class = "Qwen3_5MoeForConditionalGeneration"
    moe = True


class Qwen3_5Text(Qwen3_5):
    multimodal = False


class Qwen3_5MoeText(Qwen3_5Moe):
    multimodal = False
