"""K2-Horizon family (``model_type`` "k2_horizon"): the dense 3.7B and sparse members.

Sparse layers carry a MoE FFN (sigmoid/softmax router with a selection-only bias, routed SwiGLU
experts, ungated shared experts) and MoVA attention (values from routed value experts instead of
``v_proj``). Both kinds of routed experts run on MNN's MoE op, so only the chosen experts run at
inference. The reference is the remote code the checkpoint ships (``auto_map``, the files of
``llmexport/reference/k2_horizon``). Recommended quantization: the ``mlp4-attn8`` recipe
(docs/k2-horizon.md).
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from llmexport.checkpoint import Checkpoint, LazyTensor
from llmexport.models import register
from llmexport.models.base import (Architecture, ExpertTemplate, GraphInputs, LinearRole, LinearSource, LinearSpec,
                                   StoredWeights)
from llmexport.models.k2_horizon_args import K2HorizonArgs, parse_args
from llmexport.models.k2_horizon_graph import K2HorizonGraph, Mlp, ValueExpert, mova_layer_id
from llmexport.models.tensor_checks import check_tensors, count_limit, finite_lookup

_EXPERT_MARKER = "@expert@"
_VALUE_MARKER = "@value_expert@"
# Non-persistent in the reference; some converters still write it. Dropped, as the MLX loader does.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@register("k2_horizon")
class K2Horizon(Architecture):
    #: evaluate MoVA's value experts densely in the main graph (benchmark baseline only)
    dense_mova: bool = False
    reference_is_remote_code = True  # the checkpoint's auto_map modeling code

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint)
        self.args: K2HorizonArgs = parse_args(checkpoint.config, str(checkpoint.path / "config.json"),
                                              count_limit(checkpoint.weights))
        self._linears = self._collect_linears()
        self._check_weights()

    # --- weights ----------------------------------------------------------------------------
    def _collect_linears(self) -> list[LinearSpec]:
        a = self.args
        h, q_width, bias = a.hidden_size, a.num_heads * a.head_dim, a.attention_bias
        specs: list[LinearSpec] = []
        for layer in a.layers:
            p = f"model.layers.{layer.index}."
            specs += [LinearSpec(p + "self_attn.q_proj", h, q_width, LinearRole.ATTENTION, bias),
                      LinearSpec(p + "self_attn.k_proj", h, a.kv_width, LinearRole.ATTENTION, bias)]
            if layer.mova:
                specs.append(LinearSpec(p + "self_attn.v_router", h, a.mova.num_experts, LinearRole.ROUTER))
                # value experts are attention projections: attention-role bits, not MLP bits
                specs += [LinearSpec(p + f"self_attn.v_experts.{e}", h, a.kv_width, LinearRole.ATTENTION)
                          for e in range(a.mova.num_experts)]
            else:
                specs.append(LinearSpec(p + "self_attn.v_proj", h, a.kv_width, LinearRole.ATTENTION, bias))
            specs.append(LinearSpec(p + "self_attn.o_proj", q_width, h, LinearRole.ATTENTION, bias))
            if layer.sparse:
                specs.append(LinearSpec(p + "mlp.gate", h, a.moe.num_experts, LinearRole.ROUTER))
                for e in range(a.moe.num_experts):
                    specs += _mlp_specs(p + f"mlp.experts.{e}.", h, a.moe_width, LinearRole.EXPERT)
                if a.shared_width:
                    specs += _mlp_specs(p + "mlp.shared_experts.", h, a.shared_width, LinearRole.MLP)
            else:
                specs += _mlp_specs(p + "mlp.", h, a.intermediate_size, LinearRole.MLP)
        specs.append(LinearSpec("lm_head", h, a.vocab_size, LinearRole.LM_HEAD))
        return specs

    def _small_tensors(self) -> dict[str, tuple[int, ...]]:
        """Norm gammas and router biases: graph constants, with their expected shapes."""
        a = self.args
        shapes = {"model.norm.weight": (a.hidden_size,)}
        for layer in a.layers:
            p = f"model.layers.{layer.index}."
            shapes[p + "input_layernorm.weight"] = shapes[p + "post_attention_layernorm.weight"] = (a.hidden_size,)
            if a.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (a.num_heads * a.head_dim,)
                shapes[p + "self_attn.k_norm.weight"] = (a.kv_width,)
            if layer.mova:
                shapes[p + "self_attn.v_router.e_score_correction_bias"] = (a.mova.num_experts,)
            if layer.sparse:
                shapes[p + "mlp.gate.e_score_correction_bias"] = (a.moe.num_experts,)
        return shapes

    def _checkpoint_name(self, linear: str) -> str:
        if linear == "lm_head":
            return "model.embed_tokens.weight" if self.args.tie_embeddings else "lm_head.weight"
        return linear + ".weight"

    def _check_weights(self) -> None:
        a = self.args
        expected: dict[str, tuple[int, ...] | None] = {"model.embed_tokens.weight": (a.vocab_size, a.hidden_size)}
        for spec in self._linears:
            expected[self._checkpoint_name(spec.name)] = (spec.out_features, spec.in_features)
            if spec.bias:
                expected[spec.name + ".bias"] = (spec.out_features,)
        expected.update(self._small_tensors())
        check_tensors(self.checkpoint.weights, expected, self.checkpoint.path, "K2-Horizon",
                      ignored=lambda name: name.endswith(_IGNORED_SUFFIXES))

    def linears(self) -> list[LinearSpec]:
        return list(self._linears)

    def linear_weight(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        weights = self.checkpoint.weights
        bias = name + ".bias"
        return weights.tensor(self._checkpoint_name(name)), weights.tensor(bias) if bias in weights else None

    @property
    def tied_embedding(self) -> bool:
        return self.args.tie_embeddings

    def embedding_table(self) -> LazyTensor:
        return self.checkpoint.weights.lazy("model.embed_tokens.weight")

    # --- graph ------------------------------------------------------------------------------
    def build_graph(self) -> nn.Module:
        lookup = finite_lookup(self.checkpoint.weights, self.checkpoint.path)
        return K2HorizonGraph(self.args, lookup, dense_mova=self.dense_mova).eval()

    def graph_inputs(self, seq_len: int) -> GraphInputs:
        args = (torch.randn(seq_len, 1, self.args.hidden_size), torch.zeros(1, 1, seq_len, seq_len),
                torch.arange(seq_len, dtype=torch.int32).view(1, -1), torch.tensor([-1], dtype=torch.int32))
        axes = {"input_ids": {0: "seq_len"}, "attention_mask": {2: "seq_len", 3: "kv_len"},
                "position_ids": {1: "seq_len"}}
        return GraphInputs(args, ["input_ids", "attention_mask", "position_ids", "logits_index"], axes,
                           ["logits", "hidden_states"])

    def expert_templates(self) -> list[ExpertTemplate]:
        a = self.args
        templates = []
        sparse = [layer for layer in a.layers if layer.sparse]
        if sparse:
            instances = tuple((layer.index, e, f"model.layers.{layer.index}.mlp.experts.{e}")
                              for layer in sparse for e in range(a.moe.num_experts))
            templates.append(ExpertTemplate(Mlp(_EXPERT_MARKER + ".", a.hidden_size, a.moe_width).eval(),
                                            _EXPERT_MARKER, a.hidden_size, instances))
        mova = [layer for layer in a.layers if layer.mova]
        if mova and not self.dense_mova:
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
        a = self.args
        # attn_scale is left to the runtime default, 1/sqrt(head_dim), which is the family's;
        # the graph's Attention ops carry the same scale.
        config: dict[str, Any] = {"model_type": "k2_horizon", "hidden_size": a.hidden_size,
                                  "layer_nums": a.num_layers, "attention_type": "full",
                                  "max_position_embeddings": a.max_position_embeddings}
        jinja = self._chat_template()
        if jinja:
            config["jinja"] = jinja
        return config

    def _chat_template(self) -> dict[str, str] | None:
        """The checkpoint's own chat template, bos and eos strings (passed through unchanged)."""
        path = self.checkpoint.path
        tok_config: dict[str, Any] = {}
        if (path / "tokenizer_config.json").exists():
            tok_config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        template = tok_config.get("chat_template")
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        if not isinstance(template, str):
            return None
        out = {"chat_template": template}
        for key in ("bos", "eos"):
            token = tok_config.get(f"{key}_token")
            token = token.get("content") if isinstance(token, dict) else token
            if isinstance(token, str):
                out[key] = token
        return out

    def runtime_config(self) -> dict[str, Any]:
        # fp32 activations: routers pick experts by score differences that fp16 can flip
        # (see docs/k2-horizon.md for what was and was not measurable).
        return {"precision": "normal"}

    # --- reference --------------------------------------------------------------------------
    def load_reference(self, stored: StoredWeights | None, trust_remote_code: bool = False) -> nn.Module:
        from transformers import AutoModelForCausalLM

        model = self.checkpoint.from_pretrained(AutoModelForCausalLM, trust_remote_code=trust_remote_code,
                                                dtype=torch.float32)
        model.eval()
        if stored:
            self._apply_stored(model, stored)
        return model

    def _apply_stored(self, model: nn.Module, stored: StoredWeights) -> None:
        params = dict(model.named_parameters(remove_duplicate=False))
        targets = [(self._checkpoint_name(name), value) for name, value in stored.linears.items()]
        if stored.embedding is not None and not self.args.tie_embeddings:
            targets.append(("model.embed_tokens.weight", stored.embedding))
        with torch.no_grad():
            for target, value in targets:
                params[target].copy_(value.float())

    def reference_logits(self, model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids.view(1, -1), use_cache=False).logits[0].float()

    # --- MLX checkpoints (llmexport/mlx_import.py) ------------------------------------------------
    def linear_source(self, name: str) -> LinearSource:
        bias = name + ".bias"
        return LinearSource(self._checkpoint_name(name), None, bias if bias in self.checkpoint.weights else None)

    @classmethod
    def mlx_layout(cls, config: dict[str, Any]):
        """The family's MLX port keeps the HF names but stacks routed experts ``[E, out, in]``
        (docs/k2-horizon.md): MoE experts as ``mlp.switch_mlp.{gate,up,down}_proj`` (mlx-lm's
        SwitchGLU naming), MoVA value experts as one ``self_attn.v_experts`` SwitchLinear."""
        from llmexport.mlx_import import MlxLayout, MlxRule

        return MlxLayout((
            MlxRule(r"^(model\.layers\.\d+\.mlp)\.switch_mlp\.(\w+_proj)\.weight$", r"\1.experts.{e}.\2.weight", True),
            MlxRule(r"^(model\.layers\.\d+\.self_attn\.v_experts)\.weight$", r"\1.{e}.weight", True),
        ))


def _mlp_specs(prefix: str, hidden: int, width: int, role: LinearRole) -> list[LinearSpec]:
    return [LinearSpec(prefix + "gate_proj", hidden, width, role), LinearSpec(prefix + "up_proj", hidden, width, role),
            LinearSpec(prefix + "down_proj", width, hidden, role)]
