"""Qwen3.5 (all four model types): the rewrite (eager) vs transformers, text M-RoPE as 1-D RoPE,
ONNX (onnxruntime, other lengths than traced) vs the rewrite, the MNN-flavoured trace, the runtime
files and config/checkpoint problems as input errors."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmexport.errors import InputError
from llmexport.models.rope import RopeSpec, rope_cos_sin
from llmexport.source.checkpoint import Checkpoint
from llmexport.source.loading import open_architecture
from llmexport.spec import LinearRole
from llmexport.tiny.byte_level_tokenizer import CHATML_TEMPLATE
from llmexport.tiny.qwen3_5 import MODEL_TYPES, VARIANTS, build_qwen3_5_checkpoint, random_config, restack_experts
from llmexport.trace.eager import bind_weights
from llmexport.trace.ops import GATED_DELTA_RULE

from families import parametrize
from helpers import (
    assert_alteration_shows,
    assert_config_edit_is_typed,
    assert_reference_onnx_matches_eager,
    custom_nodes,
    edit_checkpoint,
    rewrite_and_reference,
    set_or_delete,
)

MODEL_TYPE = {variant: model_type for variant, (model_type, _) in VARIANTS.items()}
RANDOM_POINTS = [(model_type, seed) for model_type in sorted(MODEL_TYPES) for seed in (400, 401)]


#: fp32 rounding between two orders of the same sums (HF's chunked delta rule, its rsqrt norms), which a
#: value head near zero amplifies through the gated RMSNorm (measured: up to 7e-5 of the largest logit)

RELATIVE = 1e-4


def _assert_close(ours, ref):
    assert (ours - ref).abs().max().item() < RELATIVE * ref.abs().max().item()


@parametrize("rewrite", "variant", sorted(VARIANTS), MODEL_TYPE.get)
def test_rewrite_matches_hf(tiny_qwen3_5, variant):
    torch.manual_seed(1)
    ids = torch.randint(5, 440, (21,))
    arch, _, ours, ref = rewrite_and_reference(tiny_qwen3_5(variant), ids)
    assert arch.checkpoint.model_type == MODEL_TYPE[variant]
    assert ours.shape == ref.shape == (21, 512)
    assert ref.abs().max() > 1.0  # not degenerate
    _assert_close(ours, ref)


def test_stacked_and_per_expert_layouts_export_the_same_model(tiny_qwen3_5, tmp_path):
    """The same weights stored per expert and stacked: each stacked expert reads gate_up [2 * width,
    hidden] and down [hidden, width] rows of its tensors and the eager graphs give the same logits."""
    per_expert = tiny_qwen3_5("qwen3_5-moe")
    stacked = shutil.copytree(per_expert, tmp_path / "stacked")
    restack_experts(stacked)
    torch.manual_seed(2)
    ids = torch.randint(5, 440, (13,))
    (a, graph_a, ours_a, _), (b, graph_b, ours_b, _) = (rewrite_and_reference(p, ids) for p in (per_expert, stacked))
    assert (a.stacked, b.stacked) == (False, True)
    assert (ours_a - ours_b).abs().max().item() < 1e-6 * ours_a.abs().max().item()
    width, hidden = a.args.moe.width, a.args.hidden_size
    name = f"{P}.2.mlp.experts.5"
    gate_up, _ = b.linear_weight(f"{name}.gate_up_proj")
    down, _ = b.linear_weight(f"{name}.down_proj")
    assert gate_up.shape == (2 * width, hidden) and down.shape == (hidden, width)
    assert torch.equal(gate_up, torch.cat([a.linear_weight(f"{name}.gate_proj")[0],
                                           a.linear_weight(f"{name}.up_proj")[0]]))
    assert torch.equal(down, a.linear_weight(f"{name}.down_proj")[0])
    assert {s.role for s in b.linears() if ".experts." in s.name} == {LinearRole.EXPERT}


def _layer(graph, kind: str):
    return next(layer.self_attn for layer in graph.layers if type(layer.self_attn).__name__ == kind)


def _swap_gate_up(experts) -> None:
    for expert in experts:
        gate, up = expert.gate_up_proj.weight.chunk(2)
        expert.gate_up_proj.weight.copy_(torch.cat([up, gate]))


@pytest.mark.parametrize("variant, alter", [
    # a conv tap, a decay constant, the gated norm's gamma, the delta rule's beta input
    ("qwen3_5", lambda g: _layer(g, "GatedDeltaNet").conv_weight[3, 0, 1].mul_(1.5)),
    ("qwen3_5-text", lambda g: _layer(g, "GatedDeltaNet").A_log.add_(0.05)),
    ("qwen3_5", lambda g: _layer(g, "GatedDeltaNet").dt_bias.mul_(1.05)),
    ("qwen3_5", lambda g: _layer(g, "GatedDeltaNet").norm.weight.mul_(1.05)),
    # the full layers' q norm, the attention gate (q_proj's second half of a head), the frequencies
    ("qwen3_5-tied", lambda g: _layer(g, "GatedAttention").q_norm.weight.mul_(1.05)),
    ("qwen3_5", lambda g: _layer(g, "GatedAttention").q_proj.weight[32:64].mul_(1.5)),
    ("qwen3_5", lambda g: g.inv_freq.mul_(1.1)),
    # the router and the shared expert's gate
    ("qwen3_5-moe", lambda g: g.layers[1].mlp.routed.gate.weight.mul_(1.5)),
    ("qwen3_5-moe-text", lambda g: g.layers[0].mlp.shared_expert_gate.weight.mul_(-1.0)),
    # a stacked checkpoint's fused experts: gate rows first (swapped halves change the logits)
    ("qwen3_5-moe-stacked", lambda g: _swap_gate_up(g.layers[0].mlp.routed.experts.experts)),
])
def test_parity_check_detects_a_change(tiny_qwen3_5, variant, alter):
    """Guards against a vacuous comparison: each altered weight or constant moves the logits."""
    torch.manual_seed(1)
    assert_alteration_shows(tiny_qwen3_5(variant), alter, torch.randint(5, 440, (21,)))


@pytest.mark.parametrize("model_type, seed", RANDOM_POINTS)
def test_random_configs_match_hf(tmp_path, model_type, seed):
    config = random_config(model_type, seed)
    path = build_qwen3_5_checkpoint(tmp_path / "model", model_type, config, seed=seed,
                                    dtype=torch.float32 if seed % 2 else torch.bfloat16)
    torch.manual_seed(seed)
    ids = torch.randint(5, 440, (13,))
    arch, _, ours, ref = rewrite_and_reference(path, ids)
    assert [layer.linear for layer in arch.args.layers] == [k == "linear_attention" for k in config["layer_types"]]
    _assert_close(ours, ref)


@pytest.mark.parametrize("factor, section", [(0.25, [2, 1, 1]), (0.5, [4, 2, 2]), (1.0, [8, 4, 4])])
def test_text_positions_make_mrope_a_1d_rope(factor, section):
    """M-RoPE with three equal position rows (a text prompt) is 1-D RoPE over the rotated prefix:
    HF's Qwen3_5TextRotaryEmbedding against the graph's table; unequal rows (an image) differ."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    config = Qwen3_5TextConfig(hidden_size=64, num_attention_heads=4, head_dim=32, rope_parameters={
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": factor, "mrope_section": section,
        "mrope_interleaved": True})
    rotary = int(32 * factor)
    hf = Qwen3_5TextRotaryEmbedding(config)
    positions = torch.arange(300).view(1, 1, -1)
    x = torch.zeros(1, 300, 64)
    cos, sin = hf(x, positions.expand(3, 1, -1))
    ours_cos, ours_sin = rope_cos_sin(positions.view(1, -1).int(), RopeSpec(1e7, rotary, rotary // 2).inv_freq())
    assert cos.shape == (1, 300, rotary)
    torch.testing.assert_close(cos, ours_cos.view(1, 300, rotary), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, ours_sin.view(1, 300, rotary), rtol=0, atol=1e-6)
    image = positions.expand(3, 1, -1).clone()
    image[1] //= 7  # rows of an image grid
    assert (hf(x, image)[0] - cos).abs().max() > 0.1


@parametrize("onnx", "variant", ["qwen3_5", "qwen3_5-moe", "qwen3_5-text", "qwen3_5-moe-text"], MODEL_TYPE.get)
def test_reference_onnx_matches_eager(tiny_qwen3_5, tmp_path, variant):
    arch = open_architecture(Checkpoint.open(tiny_qwen3_5(variant)))
    graph = bind_weights(arch.build_graph(), arch.linear_weight)
    # onnxruntime's and torch's kernels sum in other orders; a delta-rule head whose q.k cancels
    # amplifies that through the gated RMSNorm (measured: up to 7e-4, logits up to 9)
    assert_reference_onnx_matches_eager(arch, graph, tmp_path / "ref.onnx", atol=2e-3)


def test_plain_onnx_recurrence_is_a_loop(tiny_qwen3_5, tmp_path):
    """The gated delta rule is one ONNX Loop per linear layer, not unrolled at the traced length."""
    import onnx

    from llmexport.trace.onnx_export import export_onnx

    arch = open_architecture(Checkpoint.open(tiny_qwen3_5("qwen3_5-text")))
    graph = bind_weights(arch.build_graph(), arch.linear_weight)
    export_onnx(graph, arch.graph_inputs(3), tmp_path / "ref.onnx", for_mnn=False)
    ops = [n.op_type for n in onnx.load(str(tmp_path / "ref.onnx")).graph.node]
    assert ops.count("Loop") == sum(layer.linear for layer in arch.args.layers) == 2


@pytest.mark.parametrize("variant", ["qwen3_5", "qwen3_5-moe-text", "qwen3_5-moe-stacked"])
def test_mnn_flavour_has_placeholders_and_ops(tiny_qwen3_5, tmp_path, variant):
    arch = open_architecture(Checkpoint.open(tiny_qwen3_5(variant)))
    path = tmp_path / "llm.onnx"
    nodes = custom_nodes(arch, path, ("Linear", "Attention", "MoE", "LinearAttention"))
    in_experts = {spec.name for spec in arch.linears() if ".experts." in spec.name}
    assert {m["name"].decode() for m in nodes["Linear"]} == {spec.name for spec in arch.linears()} - in_experts
    full = [layer.index for layer in arch.args.layers if not layer.linear]
    linear = [layer.index for layer in arch.args.layers if layer.linear]
    assert [(a["layer_index"], a["kv_shared_layer_index"]) for a in nodes["Attention"]] == [(i, -1) for i in full]
    assert all(a["scale"] == pytest.approx(32 ** -0.5) for a in nodes["Attention"])
    s = arch.args.delta
    assert [(a["name"].decode(), a["attn_type"].decode(), a["num_k_heads"], a["num_v_heads"], a["head_k_dim"],
             a["head_v_dim"], a["use_qk_l2norm"]) for a in nodes["LinearAttention"]] == [
        (f"/layers.{i}/self_attn/LinearAttention", GATED_DELTA_RULE, 2, 4, 16, 8, 1) for i in linear]
    assert (s.k_heads, s.v_heads) == (2, 4)  # more value heads than key heads
    moe = arch.args.moe
    assert sorted((m["layer_id"], m["num_experts"], m["top_k"]) for m in nodes["MoE"]) == (
        [(i, moe.num_experts, moe.top_k) for i in range(4)] if moe else [])
    assert path.stat().st_size < 200_000  # weights stay outside the graph


def test_graph_constants_are_stored_fp32(tiny_qwen3_5, tmp_path):
    """The conv kernels and the 1-D constants enter the traced graph in fp32 (the stored-weights
    reference reads the checkpoint's values: the graph must hold exactly those)."""
    import onnx
    from onnx import numpy_helper

    arch = open_architecture(Checkpoint.open(tiny_qwen3_5("qwen3_5")))
    path = tmp_path / "llm.onnx"
    custom_nodes(arch, path)
    inits = {i.name: i for i in onnx.load(str(path)).graph.initializer}
    weights = arch.checkpoint.weights
    for key in ("delta.conv", "delta.A_log", "delta.dt_bias"):
        want = weights.tensor(arch.names.name(key, layer=0)).float()
        found = [numpy_helper.to_array(i) for i in inits.values()
                 if i.data_type == onnx.TensorProto.FLOAT and tuple(i.dims) == tuple(want.shape)
                 and torch.equal(torch.from_numpy(numpy_helper.to_array(i).copy()), want)]
        assert found, key


def test_roles_and_linears(tiny_qwen3_5):
    arch = open_architecture(Checkpoint.open(tiny_qwen3_5("qwen3_5-moe")))
    specs = {spec.name: spec for spec in arch.linears()}
    p = "model.language_model.layers"
    assert specs[f"{p}.0.linear_attn.in_proj_qkv"].out_features == 2 * 2 * 16 + 4 * 8
    assert specs[f"{p}.1.self_attn.q_proj"].out_features == 2 * 4 * 32  # query and gate
    assert specs[f"{p}.1.mlp.gate"].role is LinearRole.ROUTER
    assert specs[f"{p}.1.mlp.shared_expert_gate"].role is LinearRole.ROUTER
    assert specs[f"{p}.1.mlp.experts.7.down_proj"].role is LinearRole.EXPERT
    assert specs[f"{p}.1.mlp.shared_expert.up_proj"].role is LinearRole.MLP


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_runtime_files_describe_the_family(tiny_qwen3_5, variant):
    arch = open_architecture(Checkpoint.open(tiny_qwen3_5(variant)))
    config = arch.llm_config()
    assert config["model_type"] == MODEL_TYPE[variant]
    assert config["layer_nums"] == 4 and config["attention_type"] == "full"
    assert config.get("is_mrope", False) == (MODEL_TYPE[variant] in ("qwen3_5", "qwen3_5_moe"))  # their tower
    assert "attn_scale" not in config and "sliding_window" not in config
    assert config["jinja"]["chat_template"] == CHATML_TEMPLATE
    assert arch.runtime_config() == {"precision": arch.precision.value}  # test_runtime_profile: which
    assert arch.end_of_turn_tokens() == ("<|im_end|>",)
    assert arch.tied_embedding == (variant in ("qwen3_5-tied", "qwen3_5-moe-text"))


def test_vision_tower_is_exported_where_the_checkpoint_has_one(tiny_qwen3_5, tmp_path):
    """The multimodal layout's tower becomes ``visual.mnn`` (tests/test_qwen3_5_vision*.py); without
    its tensors (mlx-lm's port drops them) the text model is exported alone, as the text types are."""
    path = tiny_qwen3_5("qwen3_5")
    assert [tower.name for tower in open_architecture(Checkpoint.open(path)).towers()] == ["visual"]
    names = Checkpoint.open(path).weights.names()
    bare = edit_checkpoint(path, tmp_path / "bare", drop=[n for n in names if n.startswith("model.visual.")])
    arch = open_architecture(Checkpoint.open(bare))
    assert arch.towers() == [] and "is_mrope" not in arch.llm_config()
    assert open_architecture(Checkpoint.open(tiny_qwen3_5("qwen3_5-text"))).towers() == []


def test_released_config_keys_read_the_same(tiny_qwen3_5, tmp_path):
    """The released checkpoints' spellings: layer kinds from ``full_attention_interval``, the keys
    transformers keeps but does not read (``attn_output_gate``, ``mamba_ssm_dtype``, the MTP head's),
    the MTP head's tensors beside the text model."""
    src = tiny_qwen3_5("qwen3_5")
    path = edit_checkpoint(src, tmp_path / "released", add={"mtp.fc.weight": torch.zeros(64, 128)})
    config = json.loads((path / "config.json").read_text())
    text = config["text_config"]
    text.pop("layer_types")
    text.update(full_attention_interval=2, attn_output_gate=True, mamba_ssm_dtype="float32", mtp_num_hidden_layers=1,
                mtp_use_dedicated_embeddings=False, partial_rotary_factor=0.25)
    (path / "config.json").write_text(json.dumps(config))
    assert open_architecture(Checkpoint.open(path)).args == open_architecture(Checkpoint.open(src)).args


def _text(variant: str, **keys):
    """config.json edits of ``variant``'s text model (under text_config when multimodal)."""
    if MODEL_TYPES[MODEL_TYPE[variant]].multimodal:
        return lambda config: config["text_config"].update(keys)
    return lambda config: config.update(keys)


P = "model.language_model.layers"


@pytest.mark.parametrize("variant, edit, message", [
    ("qwen3_5", dict(drop=[f"{P}.0.linear_attn.A_log"]), "A_log' missing"),
    ("qwen3_5", dict(drop=[f"{P}.2.linear_attn.conv1d.weight"]), "conv1d.weight' missing"),
    ("qwen3_5", dict(reshape={f"{P}.0.linear_attn.dt_bias": (5,)}), r"has shape \[5\]"),
    ("qwen3_5-text", dict(reshape={"model.layers.1.self_attn.q_proj.weight": (128, 64)}), r"has shape \[128, 64\]"),
    ("qwen3_5-text", dict(add={"model.layers.0.self_attn.q_proj.weight": torch.zeros(256, 64)}),
     "not mapped by the Qwen3.5"),
    ("qwen3_5-moe", dict(drop=[f"{P}.2.mlp.experts.5.up_proj.weight"]), "experts.5.up_proj.weight' missing"),
    ("qwen3_5-moe", dict(drop=[f"{P}.1.mlp.shared_expert_gate.weight"]), "shared_expert_gate.weight' missing"),
    # stacked experts: incomplete, mixed with per-expert tensors either way, a wrong row count
    ("qwen3_5-moe-stacked", dict(drop=[f"{P}.2.mlp.experts.down_proj"]), r"experts.down_proj' missing"),
    ("qwen3_5-moe-stacked", dict(drop=[f"{P}.3.mlp.experts.gate_up_proj"]), r"experts.gate_up_proj' missing"),
    ("qwen3_5-moe-stacked", dict(add={f"{P}.0.mlp.experts.4.up_proj.weight": torch.zeros(32, 64)}),
     r"both stacked .*experts.4.up_proj.weight"),
    ("qwen3_5-moe", dict(add={f"{P}.1.mlp.experts.down_proj": torch.zeros(8, 64, 32)}),
     r"both stacked \('model.language_model.layers.1.mlp.experts.down_proj'\)"),
    ("qwen3_5-moe-stacked", dict(reshape={f"{P}.1.mlp.experts.gate_up_proj": (8, 32, 64)}), r"has shape \[8, 32, 64\]"),
    ("qwen3_5-moe-stacked", dict(reshape={f"{P}.1.mlp.experts.down_proj": (7, 64, 32)}), r"has shape \[7, 64, 32\]"),
    ("qwen3_5", dict(edit=_text("qwen3_5", layer_types=["linear_attention", "sliding_attention"] * 2)), "layer_type"),
    ("qwen3_5-text", dict(edit=_text("qwen3_5-text", layer_types=["linear_attention"] * 3)), "layer_type"),
    ("qwen3_5-text", dict(edit=_text("qwen3_5-text", attention_bias=True)), "attention_bias"),
    ("qwen3_5", dict(edit=_text("qwen3_5", attn_output_gate=False)), "attn_output_gate"),
    ("qwen3_5-text", dict(edit=_text("qwen3_5-text", hidden_act="gelu")), "hidden_act"),
    ("qwen3_5-text", dict(edit=_text("qwen3_5-text", linear_num_value_heads=3)), "multiple of linear_num_key_heads"),
    ("qwen3_5", dict(edit=_text("qwen3_5", rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                            "original_max_position_embeddings": 4096})), "rope_type"),
    ("qwen3_5", dict(edit=_text("qwen3_5", rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                            "partial_rotary_factor": 0.03})), "partial_rotary_factor"),
    ("qwen3_5-moe-text", dict(edit=_text("qwen3_5-moe-text", num_experts_per_tok=9)), "exceeds the 8 experts"),
    ("qwen3_5", dict(edit=lambda config: config.update(text_config=3)), "text_config"),
])
def test_checkpoint_problems_are_input_errors(tiny_qwen3_5, tmp_path, variant, edit, message):
    edit = dict(edit)
    change = edit.pop("edit", None)
    path = edit_checkpoint(tiny_qwen3_5(variant), tmp_path / "bad", **edit)
    if change is not None:
        config = json.loads((path / "config.json").read_text())
        change(config)
        (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match=message) as err:
        open_architecture(Checkpoint.open(path))
    assert "\n" not in str(err.value).strip()


_JUNK = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(allow_nan=True), st.text(max_size=6),
                  st.lists(st.sampled_from(["linear_attention", "full_attention", "x"]), max_size=5),
                  st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
_KEYS = ["num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
         "intermediate_size", "vocab_size", "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "attention_bias",
         "hidden_act", "max_position_embeddings", "layer_types", "full_attention_interval", "linear_conv_kernel_dim",
         "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
         "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
         "attn_output_gate", "text_config"]


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 60)), deadline=None,
          derandomize=not os.environ.get("FUZZ_EXAMPLES"), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(variant=st.sampled_from(["qwen3_5", "qwen3_5-text", "qwen3_5-moe-text"]), key=st.sampled_from(_KEYS),
       value=_JUNK, delete=st.booleans())
def test_mutated_config_gives_typed_errors(tiny_qwen3_5, tmp_path_factory, variant, key, value, delete):
    """Whatever a config value is (the text model's, under text_config when multimodal), a typed
    one-line error or a working architecture comes out."""
    nested = MODEL_TYPES[MODEL_TYPE[variant]].multimodal and key != "text_config"
    assert_config_edit_is_typed(tiny_qwen3_5(variant), tmp_path_factory.mktemp("fuzz"), lambda config: set_or_delete(
        config["text_config"] if nested else config, key, value, delete))
