"""K2-Horizon family (``model_type`` "k2_horizon"): the dense 3.7B and sparse members.

Sparse layers carry a MoE FFN (sigmoid/softmax router with a selection-only bias, routed SwiGLU
experts, ungated shared experts) and MoVA attention (values from routed value experts instead of
``v_proj``). Both kinds of routed experts run on MNN's MoE op, so only the chosen experts run at
inference. The reference is the remote code the checkpoint ships (``auto_map``, the files of
``llmexport/reference/k2_horizon``). Recommended quantization: the ``mlp4-attn8`` recipe
(docs/k2-horizon.md).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from llmexport.checkpoint import Checkpoint
from llmexport.models import register
from llmexport.models.decoder import DecoderFamily, Shapes, attention_specs, mlp_specs, pre_norm_shapes, routed_specs
from llmexport.models.k2_horizon_args import K2HorizonArgs, parse_args
from llmexport.models.k2_horizon_graph import K2HorizonGraph, Mlp, ValueExpert, mova_layer_id
from llmexport.models.tensor_checks import count_limit, finite_lookup
from llmexport.spec import ExpertTemplate, LinearRole, LinearSpec

_EXPERT_MARKER = "@expert@"
_VALUE_MARKER = "@value_expert@"


@register("k2_horizon")
class K2Horizon(DecoderFamily):
    family = "K2-Horizon"
    # Non-persistent in the reference; some converters still write it. Dropped, as the MLX loader does.
    ignored_suffixes = ("rotary_emb.inv_freq",)
    #: evaluate MoVA's value experts densely in the main graph (benchmark baseline only)
    dense_mova: bool = False
    reference_is_remote_code = True  # the checkpoint's auto_map modeling code

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        self.args: K2HorizonArgs = parse_args(checkpoint.config, str(checkpoint.path / "config.json"),
                                              count_limit(checkpoint.weights))
        self._linears = self._collect_linears()
        self.check_weights()

    # --- weights ----------------------------------------------------------------------------
    def _collect_linears(self) -> list[LinearSpec]:
        a = self.args
        h, q_width, bias = a.hidden_size, a.num_heads * a.head_dim, a.attention_bias
        specs: list[LinearSpec] = []
        for layer in a.layers:
            p = f"model.layers.{layer.index}."
            values = None
            if layer.mova:
                assert a.mova is not None  # a MoVA layer exists only with MoVA settings
                # value experts are attention projections: attention-role bits, not MLP bits
                values = [LinearSpec(p + "self_attn.v_router", h, a.mova.num_experts, LinearRole.ROUTER)]
                values += [LinearSpec(p + f"self_attn.v_experts.{e}", h, a.kv_width, LinearRole.ATTENTION)
                           for e in range(a.mova.num_experts)]
            specs += attention_specs(p + "self_attn.", h, q_width, a.kv_width, bias, values)
            if layer.sparse:
                assert a.moe is not None  # a sparse layer exists only with experts
                specs += routed_specs(p + "mlp.", h, a.moe.num_experts, a.moe_width)
                if a.shared_width:
                    specs += mlp_specs(p + "mlp.shared_experts.", h, a.shared_width, LinearRole.MLP)
            else:
                specs += mlp_specs(p + "mlp.", h, a.intermediate_size, LinearRole.MLP)
        specs.append(LinearSpec("lm_head", h, a.vocab_size, LinearRole.LM_HEAD))
        return specs

    def constant_shapes(self) -> Shapes:
        """Norm gammas and router biases: graph constants, with their expected shapes."""
        a = self.args
        shapes: Shapes = {"model.norm.weight": (a.hidden_size,)}
        qk = (a.num_heads * a.head_dim, a.kv_width) if a.qk_norm else None  # grouped over all heads
        for layer in a.layers:
            p = f"model.layers.{layer.index}."
            shapes.update(pre_norm_shapes(p, a.hidden_size, qk))
            if layer.mova and a.mova is not None:
                shapes[p + "self_attn.v_router.e_score_correction_bias"] = (a.mova.num_experts,)
            if layer.sparse and a.moe is not None:
                shapes[p + "mlp.gate.e_score_correction_bias"] = (a.moe.num_experts,)
        return shapes

    def linears(self) -> list[LinearSpec]:
        return list(self._linears)

    # --- graph ------------------------------------------------------------------------------
    def build_graph(self) -> nn.Module:
        lookup = finite_lookup(self.checkpoint.weights, self.checkpoint.path)
        return K2HorizonGraph(self.args, lookup, dense_mova=self.dense_mova).eval()

    def expert_templates(self) -> list[ExpertTemplate]:
        a = self.args
        templates = []
        sparse = [layer for layer in a.layers if layer.sparse]
        if sparse and a.moe is not None:
            instances = tuple((layer.index, e, f"model.layers.{layer.index}.mlp.experts.{e}")
                              for layer in sparse for e in range(a.moe.num_experts))
            templates.append(ExpertTemplate(Mlp(_EXPERT_MARKER + ".", a.hidden_size, a.moe_width).eval(),
                                            _EXPERT_MARKER, a.hidden_size, instances))
        mova = [layer for layer in a.layers if layer.mova]
        if mova and a.mova is not None and not self.dense_mova:
            instances = tuple((mova_layer_id(a, layer.index), e, f"model.layers.{layer.index}.self_attn.v_experts.{e}")
                              for layer in mova for e in range(a.mova.num_experts))
            templates.append(ExpertTemplate(ValueExpert(_VALUE_MARKER, a.hidden_size, a.kv_width).eval(),
                                            _VALUE_MARKER, a.hidden_size, instances))
        return templates

    def describe(self) -> dict[str, Any]:
        a = self.args
        kinds = []
        for layer in a.layers:
            kind = ("sparse: MoE" + (" + MoVA" if layer.mova else " + v_proj")) if layer.sparse else "dense"
            kinds.append(f"{layer.index}: {kind}")
        return {"family": "k2_horizon", "model_type": "k2_horizon", "layers": a.num_layers,
                "hidden_size": a.hidden_size, "vocab_size": a.vocab_size, "norm_groups": a.norm_groups,
                "query_key_norm": a.qk_norm, "moe": None if a.moe is None else dict(vars(a.moe), width=a.moe_width,
                                                                                    shared_width=a.shared_width),
                "mova": None if a.mova is None else vars(a.mova), "tied_embeddings": a.tie_embeddings,
                "layer_kinds": kinds}

    # --- runtime files ----------------------------------------------------------------------
    def llm_config(self) -> dict[str, Any]:
        return self.full_attention_config("k2_horizon")

    def runtime_config(self) -> dict[str, Any]:
        # fp32 activations: routers pick experts by score differences that fp16 can flip
        # (see docs/k2-horizon.md for what was and was not measurable).
        return {"precision": "normal"}

    # --- reference --------------------------------------------------------------------------
    def reference_kwargs(self, trust_remote_code: bool) -> dict[str, Any]:
        return {"trust_remote_code": trust_remote_code}

    # --- MLX checkpoints (llmexport/importers/mlx) ------------------------------------------------
    @classmethod
    def mlx_layout(cls, config: dict[str, Any]):
        """The family's MLX port keeps the HF names but stacks routed experts ``[E, out, in]``
        (docs/k2-horizon.md): MoE experts as ``mlp.switch_mlp.{gate,up,down}_proj`` (mlx-lm's
        SwitchGLU naming), MoVA value experts as one ``self_attn.v_experts`` SwitchLinear."""
        from llmexport.spec import MlxLayout, MlxRule

        return MlxLayout((
            MlxRule(r"^(model\.layers\.\d+\.mlp)\.switch_mlp\.(\w+_proj)\.weight$", r"\1.experts.{e}.\2.weight", True),
            MlxRule(r"^(model\.layers\.\d+\.self_attn\.v_experts)\.weight$", r"\1.{e}.weight", True),
        ))

