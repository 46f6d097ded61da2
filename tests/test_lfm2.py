"""LFM2 / LFM2-MoE: the rewrite (eager) vs transformers' eager model, ONNX (onnxruntime) vs the
rewrite at other lengths than traced, the MNN-flavoured trace, the runtime files, config and
checkpoint problems as input errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmexport.errors import InputError
from llmexport.models.lfm2.chat_template import lfm2_jinja
from llmexport.source.checkpoint import Checkpoint
from llmexport.source.loading import open_architecture
from llmexport.tiny.byte_level_tokenizer import STYLES
from llmexport.tiny.lfm2 import TOKENIZER_STYLE, VARIANTS, build_lfm2_checkpoint, random_config
from llmexport.trace.eager import bind_weights

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


def _ids(n=21):
    torch.manual_seed(1)
    return torch.randint(5, 440, (n,))


@parametrize("rewrite", "variant", sorted(VARIANTS), MODEL_TYPE.get)
def test_rewrite_matches_hf(tiny_lfm2, variant):
    arch, _, ours, ref = rewrite_and_reference(tiny_lfm2(variant), _ids())
    assert arch.checkpoint.model_type == MODEL_TYPE[variant]
    assert ours.shape == ref.shape == (21, 512)
    assert ref.abs().max() > 1.0  # not degenerate
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("seed", range(400, 406))
def test_random_configs_match_hf(tmp_path, seed):
    model_type, config = random_config(seed)
    path = build_lfm2_checkpoint(tmp_path / "model", model_type, config, seed=seed,
                                 dtype=torch.float32 if seed % 2 else torch.bfloat16)
    arch, _, ours, ref = rewrite_and_reference(path, _ids(13))
    reference = arch.load_reference(None)
    assert [not hasattr(layer, "conv") for layer in reference.model.layers] == \
        [layer.attention for layer in arch.args.layers]
    assert [type(layer.feed_forward).__name__.endswith("SparseMoeBlock") for layer in reference.model.layers] == \
        [layer.sparse for layer in arch.args.layers]
    assert (ours - ref).abs().max().item() < 1e-4, config


@pytest.mark.parametrize("variant, alter", [
    ("dense", lambda g: g.layers[0].self_attn.conv_weight[:, 0, 0].mul_(1.5)),  # the oldest conv tap
    ("dense", lambda g: g.layers[1].self_attn.k_norm.weight.mul_(1.05)),
    ("dense", lambda g: g.norm.weight.mul_(1.05)),  # embedding_norm, the final norm
    ("moe", lambda g: g.layers[2].mlp.gate.bias.neg_()),  # the selection-only bias
    ("moe", lambda g: setattr(g.layers[3].mlp.gate, "spec", g.layers[3].mlp.gate.spec.__class__(
        **{**vars(g.layers[3].mlp.gate.spec), "normalize": False}))),
    ("moe-plain", lambda g: setattr(g.layers[3].mlp.gate, "spec", g.layers[3].mlp.gate.spec.__class__(
        **{**vars(g.layers[3].mlp.gate.spec), "scale": 1.0}))),
])
def test_parity_check_detects_a_change(tiny_lfm2, variant, alter):
    """Guards against a vacuous comparison: a conv tap, a k norm gamma, the final norm, the
    router's selection bias, its renormalisation and its scale each change the logits."""
    assert_alteration_shows(tiny_lfm2(variant), alter, _ids())


@parametrize("onnx", "variant", sorted(VARIANTS), MODEL_TYPE.get)
def test_reference_onnx_matches_eager(tiny_lfm2, tmp_path, variant):
    arch = open_architecture(Checkpoint.open(tiny_lfm2(variant)))
    graph = bind_weights(arch.build_graph(), arch.linear_weight)
    assert_reference_onnx_matches_eager(arch, graph, tmp_path / "ref.onnx")


@pytest.mark.parametrize("variant", ["dense-idxs", "moe"])
def test_mnn_flavour_has_linear_attention_attention_and_moe_ops(tiny_lfm2, tmp_path, variant):
    arch = open_architecture(Checkpoint.open(tiny_lfm2(variant)))
    a = arch.args
    path = tmp_path / "llm.onnx"
    nodes = custom_nodes(arch, path)
    in_experts = {spec.name for spec in arch.linears() if ".experts." in spec.name}
    assert {m["name"].decode() for m in nodes["Linear"]} == {spec.name for spec in arch.linears()} - in_experts
    attention = [layer.index for layer in a.layers if layer.attention]
    assert [(n["layer_index"], n["kv_shared_layer_index"]) for n in nodes["Attention"]] == [(i, -1) for i in attention]
    assert all(n["scale"] == pytest.approx(a.head_dim ** -0.5) for n in nodes["Attention"])
    conv = [layer.index for layer in a.layers if not layer.attention]
    assert [n["name"].decode() for n in nodes["LinearAttention"]] == \
        [f"/layers.{i}/self_attn/LinearAttention" for i in conv]
    for n in nodes["LinearAttention"]:
        assert n["attn_type"] == b"short_conv" and n["use_qk_l2norm"] == 0
        assert (n["num_k_heads"], n["num_v_heads"], n["head_k_dim"], n["head_v_dim"]) == (1, 1, 64, 64)
    sparse = [layer.index for layer in a.layers if layer.sparse]
    assert sorted((m["layer_id"], m["num_experts"], m["top_k"]) for m in nodes["MoE"]) == \
        [(i, a.moe.num_experts, a.moe.top_k) for i in sparse] if a.moe else not nodes["MoE"]
    assert len(in_experts) == 3 * len(sparse) * (a.moe.num_experts if a.moe else 0)
    assert path.stat().st_size < 200_000  # weights stay outside the graph


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_runtime_files_describe_the_family(tiny_lfm2, variant):
    arch = open_architecture(Checkpoint.open(tiny_lfm2(variant)))
    config = arch.llm_config()
    assert config["model_type"] == MODEL_TYPE[variant] and config["layer_nums"] == 4
    assert config["attention_type"] == "full" and "sliding_window" not in config
    assert config["jinja"] == lfm2_jinja({"chat_template": STYLES[TOKENIZER_STYLE].chat_template,
                                          "bos": "<|startoftext|>", "eos": "<|im_end|>"})
    assert arch.runtime_config() == {"precision": arch.precision.value}  # test_runtime_profile: which
    assert arch.end_of_turn_tokens() == ("<|im_end|>",)
    assert arch.tied_embedding == (variant != "dense-idxs")


def test_mlp_width_follows_lfm2s_adjustment(tiny_lfm2):
    """Lfm2MLP: int(2 * 144 / 3) = 96, rounded up to a multiple of 32 -> 96; LFM2-MoE's dense
    layers keep intermediate_size."""
    dense = open_architecture(Checkpoint.open(tiny_lfm2("dense"))).args
    assert dense.intermediate_size == 96 and dense.conv_kernel == 3
    idxs = open_architecture(Checkpoint.open(tiny_lfm2("dense-idxs"))).args
    assert [layer.attention for layer in idxs.layers] == [True, False, True, False] and idxs.conv_kernel == 4
    moe = open_architecture(Checkpoint.open(tiny_lfm2("moe"))).args
    assert moe.intermediate_size == 96 and [layer.sparse for layer in moe.layers] == [False, True, True, True]
    assert moe.moe.normalize and moe.expert_bias


@pytest.mark.parametrize("variant, edit, message", [
    ("dense", dict(config={"conv_bias": True}), "'conv_bias'"),
    ("dense", dict(config={"conv_L_cache": 1}), "'conv_L_cache'"),
    ("dense", dict(config={"layer_types": ["conv", "sliding_attention", "conv", "full_attention"]}), "layer_types"),
    ("moe", dict(config={"layer_types": None}), "layer_types"),
    ("moe", dict(config={"num_experts_per_tok": 9}), "exceeds the 8 experts"),
    ("dense", dict(config={"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0,
                                               "original_max_position_embeddings": 4096}}), "rope_type"),
    ("dense", dict(drop=["model.layers.0.conv.conv.weight"]), "conv.conv.weight' missing"),
    ("dense", dict(reshape={"model.layers.2.conv.conv.weight": (64, 1, 4)}), r"has shape \[64, 1, 4\]"),
    ("dense", dict(drop=["model.layers.1.self_attn.q_layernorm.weight"]), "q_layernorm.weight' missing"),
    ("dense", dict(add={"model.layers.0.conv.in_proj.bias": torch.zeros(192)}), "not mapped by the LFM2"),
    ("moe", dict(drop=["model.layers.1.feed_forward.expert_bias"]), "expert_bias' missing"),
    ("moe", dict(drop=["model.layers.2.feed_forward.experts.5.w3.weight"]), "experts.5.w3.weight' missing"),
])
def test_checkpoint_problems_are_input_errors(tiny_lfm2, tmp_path, variant, edit, message):
    path = edit_checkpoint(tiny_lfm2(variant), tmp_path / "bad", **edit)
    with pytest.raises(InputError, match=message) as info:
        open_architecture(Checkpoint.open(path))
    assert "\n" not in str(info.value).strip()


_JUNK = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(allow_nan=True), st.text(max_size=6),
                  st.lists(st.sampled_from(["conv", "full_attention", "sliding_attention", 0, 2]), max_size=5),
                  st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
_KEYS = ["num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
         "intermediate_size", "vocab_size", "norm_eps", "rope_parameters", "tie_word_embeddings", "conv_bias",
         "conv_L_cache", "layer_types", "full_attn_idxs", "block_auto_adjust_ff_dim", "block_ffn_dim_multiplier",
         "block_multiple_of", "num_dense_layers", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
         "use_expert_bias", "norm_topk_prob", "routed_scaling_factor", "max_position_embeddings"]


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(variant=st.sampled_from(["dense", "moe"]), key=st.sampled_from(_KEYS), value=_JUNK, delete=st.booleans())
def test_mutated_config_gives_typed_errors(tiny_lfm2, tmp_path_factory, variant, key, value, delete):
    """Whatever a config value is, a typed one-line error or a working architecture comes out."""
    assert_config_edit_is_typed(tiny_lfm2(variant), tmp_path_factory.mktemp("fuzz"),
                                lambda config: set_or_delete(config, key, value, delete))
