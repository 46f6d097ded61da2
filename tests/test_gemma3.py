"""Gemma3 text: the rewrite (eager) vs transformers, ONNX (onnxruntime) vs the rewrite, the
MNN-flavoured trace, the runtime files, config spellings and refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from llmexport.errors import InputError
from llmexport.source.checkpoint import Checkpoint
from llmexport.source.loading import open_architecture
from llmexport.tiny.gemma3 import VARIANTS, build_gemma3_checkpoint, random_config
from llmexport.trace.eager import bind_weights

from families import parametrize
from helpers import (
    assert_reference_onnx_matches_eager,
    custom_nodes,
    edit_checkpoint,
    rewrite_and_reference,
    rewrite_logits,
)


def _ids(n=21):
    torch.manual_seed(1)
    return torch.randint(5, 440, (n,))


@parametrize("rewrite", "variant", sorted(VARIANTS), "gemma3_text")
def test_rewrite_matches_hf(tiny_gemma3, variant):
    arch, _, ours, ref = rewrite_and_reference(tiny_gemma3(variant), _ids())
    assert arch.checkpoint.model_type == "gemma3_text"
    assert ours.shape == ref.shape == (21, 512)
    assert ref.abs().max() > 1.0  # not degenerate
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("variant, alter", [
    # the stored norm weight is an offset from 1: scaling the graph's gamma is visible
    ("1b", lambda g: g.layers[1].pre_feedforward_layernorm.weight.mul_(1.05)),
    ("1b", lambda g: g.layers[0].self_attn.k_norm.weight.mul_(1.05)),
    # the sliding layers' RoPE table set to the full layers'
    ("1b", lambda g: g.inv_freq_sliding_attention.copy_(g.inv_freq_full_attention)),
    # linear RoPE scaling undone
    ("scaled", lambda g: g.inv_freq_full_attention.mul_(8.0)),
])
def test_parity_check_detects_a_change(tiny_gemma3, variant, alter):
    arch, graph, _, ref = rewrite_and_reference(tiny_gemma3(variant), _ids())
    with torch.no_grad():
        alter(graph)
    assert (rewrite_logits(arch, graph, _ids()) - ref).abs().max().item() > 1e-3


def test_sliding_window_is_visible(tiny_gemma3, tmp_path):
    """The 21-token prompt is longer than the window: a wider window changes HF's logits, and the
    rewrite follows the window it is given."""
    src = tiny_gemma3("1b")
    wide = edit_checkpoint(src, tmp_path / "wide", config={"sliding_window": 64})
    _, _, ours, ref = rewrite_and_reference(wide, _ids())
    _, _, _, narrow = rewrite_and_reference(src, _ids())
    assert (ours - ref).abs().max().item() < 1e-4
    assert (ref - narrow).abs().max().item() > 1e-3


@pytest.mark.parametrize("seed", range(400, 404))
def test_random_configs_match_hf(tmp_path, seed):
    config = random_config(seed)
    path = build_gemma3_checkpoint(tmp_path / "model", config, seed=seed,
                                   dtype=torch.float32 if seed % 2 else torch.bfloat16)
    _, _, ours, ref = rewrite_and_reference(path, _ids(13))
    assert (ours - ref).abs().max().item() < 1e-4, config


@parametrize("onnx", "variant", ["1b", "scaled", "full"], "gemma3_text")
def test_reference_onnx_matches_eager(tiny_gemma3, tmp_path, variant):
    arch = open_architecture(Checkpoint.open(tiny_gemma3(variant)))
    graph = bind_weights(arch.build_graph(), arch.linear_weight)
    assert_reference_onnx_matches_eager(arch, graph, tmp_path / "ref.onnx")


def test_mnn_flavour_has_placeholders_and_scaled_attention(tiny_gemma3, tmp_path):
    arch = open_architecture(Checkpoint.open(tiny_gemma3("1b")))
    path = tmp_path / "llm.onnx"
    nodes = custom_nodes(arch, path)
    assert {m["name"].decode() for m in nodes["Linear"]} == {spec.name for spec in arch.linears()}
    assert [(a["layer_index"], a["kv_shared_layer_index"]) for a in nodes["Attention"]] == [(i, -1) for i in range(4)]
    assert all(a["scale"] == pytest.approx(24 ** -0.5) for a in nodes["Attention"])  # query_pre_attn_scalar


@pytest.mark.parametrize("variant, attention", [("1b", "mix"), ("full", "full")])
def test_runtime_files_describe_the_family(tiny_gemma3, variant, attention):
    arch = open_architecture(Checkpoint.open(tiny_gemma3(variant)))
    config = arch.llm_config()
    assert config["model_type"] == "gemma3" and config["attention_type"] == attention
    assert config.get("sliding_window") == (6 if attention == "mix" else None)
    assert config["attn_scale"] == pytest.approx(24 ** -0.5)
    assert "<start_of_turn>" in config["jinja"]["chat_template"]
    assert arch.runtime_config() == {"precision": arch.precision.value}  # test_runtime_profile: which
    assert arch.tied_embedding == (variant != "scaled")
    assert arch.describe().layer_kinds[2] == "2: full"


def test_transformers_4_config_keys_read_the_same(tiny_gemma3, tmp_path):
    """Hub configs of Gemma 3 spell the RoPE bases rope_theta / rope_local_base_freq and the
    full layers' scaling rope_scaling; absent layer_types follow sliding_window_pattern."""
    src = tiny_gemma3("scaled")
    dst = shutil.copytree(src, tmp_path / "legacy")
    config = json.loads((src / "config.json").read_text())
    config.pop("rope_parameters")
    config.pop("layer_types")
    config.update(rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, sliding_window_pattern=2,
                  rope_scaling={"rope_type": "linear", "factor": 8.0})
    (dst / "config.json").write_text(json.dumps(config))
    assert open_architecture(Checkpoint.open(dst)).args == open_architecture(Checkpoint.open(src)).args


@pytest.mark.parametrize("edit, message", [
    (dict(config={"attn_logit_softcapping": 50.0}), "attn_logit_softcapping"),
    (dict(config={"use_bidirectional_attention": True}), "use_bidirectional_attention"),
    (dict(config={"hidden_activation": "silu"}), "hidden_activation"),
    (dict(config={"sliding_window": None}), "sliding_window"),
    (dict(config={"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0},
                                      "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}), "yarn"),
    (dict(config={"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                      "full_attention": {"rope_type": "default", "rope_theta": 1e6,
                                                         "partial_rotary_factor": 0.5}}}), "partial_rotary_factor"),
    (dict(drop=["model.layers.1.pre_feedforward_layernorm.weight"]), "pre_feedforward_layernorm.weight' missing"),
    (dict(reshape={"model.layers.0.self_attn.q_norm.weight": (64,)}), r"has shape \[64\]"),
])
def test_checkpoint_problems_are_input_errors(tiny_gemma3, tmp_path, edit, message):
    path = edit_checkpoint(tiny_gemma3("1b"), tmp_path / "bad", **edit)
    with pytest.raises(InputError, match=message) as info:
        open_architecture(Checkpoint.open(path))
    assert "\n" not in str(info.value).strip()
