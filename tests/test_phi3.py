"""Phi-3 / Phi-4-mini: the rewrite (eager) vs transformers, ONNX vs the rewrite, the exported
context, refusals."""

from __future__ import annotations

import pytest
import torch

from llmexport.errors import InputError
from llmexport.source.checkpoint import Checkpoint
from llmexport.source.loading import open_architecture
from llmexport.tiny.phi3 import VARIANTS
from llmexport.trace.eager import bind_weights

from families import parametrize
from helpers import (
    assert_alteration_shows,
    assert_reference_onnx_matches_eager,
    custom_nodes,
    edit_checkpoint,
    rewrite_and_reference,
    rewrite_logits,
)


def _ids(n=21):
    torch.manual_seed(1)
    return torch.randint(5, 440, (n,))


@parametrize("rewrite", "variant", sorted(VARIANTS), "phi3")
def test_rewrite_matches_hf(tiny_phi3, variant):
    arch, _, ours, ref = rewrite_and_reference(tiny_phi3(variant), _ids())
    assert arch.checkpoint.model_type == "phi3"
    assert ref.abs().max() > 1.0
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("alter", [
    lambda g: g.inv_freq.mul_(torch.linspace(1.0, 1.3, g.inv_freq.numel())),  # other short factors
    lambda g: setattr(g.layers[0].self_attn, "factor", 1.0),  # no longrope attention factor
])
def test_parity_check_detects_a_change(tiny_phi3, alter):
    arch, graph, _, ref = rewrite_and_reference(tiny_phi3("phi4-mini"), _ids())
    with torch.no_grad():
        alter(graph)
    assert (rewrite_logits(arch, graph, _ids()) - ref).abs().max().item() > 1e-3


def test_the_sliding_window_is_applied(tiny_phi3):
    """Phi-3-mini-4k's window (12 in the tiny one, below the prompt's 21 tokens): the rewrite with
    every layer on the full mask instead is visibly off HF's."""
    arch = open_architecture(Checkpoint.open(tiny_phi3("phi3-mini-4k")))
    assert arch.sliding_window == 12 and arch.llm_config()["attention_type"] == "mix"
    assert_alteration_shows(tiny_phi3("phi3-mini-4k"), lambda g: setattr(g, "sliding", (False,) * len(g.layers)),
                            _ids())


@parametrize("onnx", "variant", sorted(VARIANTS), "phi3")
def test_reference_onnx_matches_eager(tiny_phi3, tmp_path, variant):
    arch = open_architecture(Checkpoint.open(tiny_phi3(variant)))
    graph = bind_weights(arch.build_graph(), arch.linear_weight)
    assert_reference_onnx_matches_eager(arch, graph, tmp_path / "ref.onnx", vocab=523)


def test_fused_linears_and_exported_context(tiny_phi3, tmp_path):
    arch = open_architecture(Checkpoint.open(tiny_phi3("phi4-mini")))
    nodes = custom_nodes(arch, tmp_path / "llm.onnx")
    names = {m["name"].decode() for m in nodes["Linear"]}
    assert "model.layers.0.self_attn.qkv_proj" in names and "model.layers.2.mlp.gate_up_proj" in names
    assert arch.args.rotary_dim == 12
    # longrope: the short factors are exact up to original_max_position_embeddings, so that is the context
    assert arch.llm_config()["max_position_embeddings"] == 256


@pytest.mark.parametrize("edit, message", [
    (dict(config={"hidden_act": "gelu"}), "hidden_act"),
    (dict(config={"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}), "rope_type"),
    (dict(config={"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0],
                                      "long_factor": [1.0], "original_max_position_embeddings": 256}}),
     "validate_rope"),  # transformers' own check (it logs the short_factor length)
    (dict(drop=["model.layers.1.self_attn.qkv_proj.weight"]), "qkv_proj.weight' missing"),
])
def test_checkpoint_problems_are_input_errors(tiny_phi3, tmp_path, edit, message):
    path = edit_checkpoint(tiny_phi3("phi4-mini"), tmp_path / "bad", **edit)
    with pytest.raises(InputError, match=message) as info:
        open_architecture(Checkpoint.open(path))
    assert "\n" not in str(info.value).strip()
