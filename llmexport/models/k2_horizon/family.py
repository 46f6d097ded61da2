"""K2-Horizon family (``model_type`` "k2_horizon"): the dense 3.7B and sparse members.

Sparse layers carry a MoE FFN (sigmoid/softmax router with a selection-only bias, routed SwiGLU
experts, ungated shared experts) and MoVA attention (values from routed value experts instead of
``v_proj``). Both kinds of routed experts run on MNN's MoE op, so only the chosen experts run at
inference. The reference is the remote code the checkpoint ships (``auto_map``, the files of
``llmexport/reference/k2_horizon``). Recommended quantization: the ``mlp4-attn8`` recipe
(docs/k2-horizon.md).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn

from llmexport.mnn.config import Precision
from llmexport.models.decoder.family import DecoderFamily, expert_template
from llmexport.models.decoder.names import EXPERT_MLP, MLP, add_attention, add_mlp, add_routed, pre_norm_shapes
from llmexport.models.k2_horizon.args import K2HorizonArgs, parse_args
from llmexport.models.k2_horizon.graph import K2HorizonGraph, Mlp, ValueExpert, mova_layer_id
from llmexport.models.k2_horizon.names import K2_HORIZON_NAMES, MLX_STACKED, SHARED_MLP
from llmexport.models.tensor_checks import Shapes, count_limit, finite_lookup
from llmexport.models.tensor_names import LinearList, rename_rule, weight_name
from llmexport.source.checkpoint import Checkpoint
from llmexport.spec import ArchitectureSummary, ExpertTemplate, LinearRole, MlxLayout

_VALUE_MARKER = "@value_expert@"


class K2Horizon(DecoderFamily):
    #: fp32 activations: fp16 flips router choices on MNN's ARM kernels (docs/benchmarks.md, "fp16 on ARM")
    precision = Precision.NORMAL
    family = "K2-Horizon"
    names = K2_HORIZON_NAMES
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
    def _collect_linears(self) -> LinearList:
        a = self.args
        h, q_width, bias = a.hidden_size, a.num_heads * a.head_dim, a.attention_bias
        linears = LinearList(self.names)
        for layer in a.layers:
            values = partial(self._add_value_experts, linears, layer.index) if layer.mova else None
            add_attention(linears, layer.index, h, q_width, a.kv_width, bias, values)
            if layer.sparse:
                assert a.moe is not None  # a sparse layer exists only with experts
                add_routed(linears, layer.index, h, a.moe.num_experts, a.moe_width)
                if a.shared_width:
                    add_mlp(linears, SHARED_MLP, h, a.shared_width, LinearRole.MLP, layer=layer.index)
            else:
                add_mlp(linears, MLP, h, a.intermediate_size, LinearRole.MLP, layer=layer.index)
        self.add_head(linears)
        return linears

    def _add_value_experts(self, linears: LinearList, layer: int) -> None:
        """MoVA's value router and experts in ``v_proj``'s place. Value experts are attention
        projections: attention-role bits, not MLP bits."""
        a = self.args
        assert a.mova is not None  # a MoVA layer exists only with MoVA settings
        linears.add("attn.v_router", a.hidden_size, a.mova.num_experts, LinearRole.ROUTER, layer=layer)
        for e in range(a.mova.num_experts):
            linears.add("attn.v_expert", a.hidden_size, a.kv_width, LinearRole.ATTENTION, layer=layer, expert=e)

    def constant_shapes(self) -> Shapes:
        """Norm gammas and router biases: graph constants, with their expected shapes."""
        a, names = self.args, self.names
        shapes: Shapes = {names.name("norm.final"): (a.hidden_size,)}
        qk = (a.num_heads * a.head_dim, a.kv_width) if a.qk_norm else None  # grouped over all heads
        for layer in a.layers:
            shapes.update(pre_norm_shapes(names, layer.index, a.hidden_size, qk))
            if layer.mova and a.mova is not None:
                shapes[names.name("attn.v_router.bias", layer=layer.index)] = (a.mova.num_experts,)
            if layer.sparse and a.moe is not None:
                shapes[names.name("moe.router.bias", layer=layer.index)] = (a.moe.num_experts,)
        return shapes

    # --- graph ------------------------------------------------------------------------------
    def build_graph(self) -> nn.Module:
        lookup = finite_lookup(self.checkpoint.weights, self.checkpoint.path)
        return K2HorizonGraph(self.args, self.names, lookup, dense_mova=self.dense_mova).eval()

    def expert_templates(self) -> list[ExpertTemplate]:
        a, h = self.args, self.args.hidden_size
        templates = []
        sparse = [layer for layer in a.layers if layer.sparse]
        if sparse and a.moe is not None:
            templates.append(expert_template(
                self.names, "moe.expert", EXPERT_MLP, lambda names: Mlp(names, h, a.moe_width), h,
                ((layer.index, layer.index, e) for layer in sparse for e in range(a.moe.num_experts))))
        mova = [layer for layer in a.layers if layer.mova]
        if mova and a.mova is not None and not self.dense_mova:
            templates.append(expert_template(
                self.names, "attn.v_expert", ("attn.v_expert",), lambda names: ValueExpert(names[0], h, a.kv_width), h,
                ((mova_layer_id(a, layer.index), layer.index, e) for layer in mova for e in range(a.mova.num_experts)),
                marker=_VALUE_MARKER))
        return templates

    def describe(self) -> ArchitectureSummary:
        a = self.args
        kinds = []
        for layer in a.layers:
            kind = ("sparse: MoE" + (" + MoVA" if layer.mova else " + v_proj")) if layer.sparse else "dense"
            kinds.append(f"{layer.index}: {kind}")
        moe = None if a.moe is None else dict(vars(a.moe), width=a.moe_width, shared_width=a.shared_width)
        return ArchitectureSummary("k2_horizon", "k2_horizon", a.num_layers, a.hidden_size, a.vocab_size,
                                   a.tie_embeddings, tuple(kinds),
                                   {"norm_groups": a.norm_groups, "query_key_norm": a.qk_norm, "moe": moe,
                                    "mova": None if a.mova is None else vars(a.mova)})

    # --- runtime files ----------------------------------------------------------------------
    def llm_config(self) -> dict[str, Any]:
        return self.full_attention_config("k2_horizon")


    # --- reference --------------------------------------------------------------------------
    def reference_kwargs(self, trust_remote_code: bool) -> dict[str, Any]:
        return {"trust_remote_code": trust_remote_code}

    # --- MLX checkpoints (llmexport/source/importers/mlx) ------------------------------------------------
    @classmethod
    def mlx_layout(cls, config: dict[str, Any]) -> MlxLayout:
        """The family's MLX port (``MLX_STACKED``): each stacked tensor split into its experts' weights."""
        return MlxLayout(tuple(rename_rule(mlx, weight_name(cls.names.pattern(key)), split="expert")
                               for mlx, key in MLX_STACKED.items()))

