"""K2-Horizon export graph: the rewrite (eager) vs the reference, ONNX (onnxruntime) vs the rewrite,
the MNN-flavoured trace, and the checkpoint checks."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from llmexport.errors import InputError
from llmexport.models.k2_horizon.family import K2Horizon
from llmexport.source.checkpoint import Checkpoint
from llmexport.source.loading import open_architecture
from llmexport.tiny.k2_horizon import build_k2_horizon_checkpoint, random_config
from llmexport.trace.eager import bind_weights, prompt_inputs

from families import parametrize
from helpers import assert_reference_onnx_matches_eager, custom_nodes, edit_checkpoint

VARIANTS = ("dense", "sparse", "sparse-qknorm")
SEEDS = list(range(200, 212))


def _rewrite_logits(arch, ids, dense_mova=False):
    with mock.patch.object(K2Horizon, "dense_mova", dense_mova):
        graph = bind_weights(arch.build_graph(), arch.linear_weight)
    with torch.no_grad():
        return graph, graph(*prompt_inputs(arch, ids, arch.embedding_table(), None))[0][0]


@parametrize("rewrite", "variant", VARIANTS, "k2_horizon")
def test_rewrite_matches_reference(tiny_k2_horizon, variant):
    arch = open_architecture(Checkpoint.open(tiny_k2_horizon(variant)))
    torch.manual_seed(1)
    ids = torch.randint(5, 500, (21,))
    _, ours = _rewrite_logits(arch, ids)
    _, dense = _rewrite_logits(arch, ids, dense_mova=True)
    ref = arch.reference_logits(arch.load_reference(None, trust_remote_code=True), ids)
    assert ours.shape == ref.shape == (21, 512)
    assert ref.abs().max() > 1.0  # not degenerate
    assert (ours - ref).abs().max().item() < 1e-4
    assert (dense - ours).abs().max().item() < 1e-5  # the benchmark's dense MoVA computes the same


def test_parity_check_detects_a_wrong_router_bias(tiny_k2_horizon):
    """Guards against a vacuous comparison: the selection-only bias must matter."""
    arch = open_architecture(Checkpoint.open(tiny_k2_horizon("sparse")))
    torch.manual_seed(1)
    ids = torch.randint(5, 500, (21,))
    graph, ours = _rewrite_logits(arch, ids)
    with torch.no_grad():
        graph.layers[1].self_attn.v_router.bias.zero_()
        altered = graph(*prompt_inputs(arch, ids, arch.embedding_table(), None))[0][0]
    assert (altered - ours).abs().max().item() > 1e-2


@pytest.mark.parametrize("seed", SEEDS)
def test_random_variant_rewrite_matches_reference(tmp_path, seed):
    config = random_config(seed)
    path = build_k2_horizon_checkpoint(tmp_path / "model", config, seed=seed,
                                       dtype=torch.float32 if seed % 2 else torch.bfloat16)
    arch = open_architecture(Checkpoint.open(path))
    sparse = [layer.index for layer in arch.args.layers if layer.sparse]
    reference = arch.load_reference(None, trust_remote_code=True)
    assert sparse == [i for i in range(config["num_hidden_layers"]) if reference.config.is_sparse_layer(i)]
    torch.manual_seed(seed)
    ids = torch.randint(5, 500, (13,))
    _, ours = _rewrite_logits(arch, ids)
    ref = arch.reference_logits(reference, ids)
    assert (ours - ref).abs().max().item() < 1e-4, config


@parametrize("onnx", "variant", ["dense", "sparse-qknorm"], "k2_horizon")  # between them, every feature
def test_reference_onnx_matches_eager(tiny_k2_horizon, tmp_path, variant):
    arch = open_architecture(Checkpoint.open(tiny_k2_horizon(variant)))
    graph = bind_weights(arch.build_graph(), arch.linear_weight)
    assert_reference_onnx_matches_eager(arch, graph, tmp_path / "ref.onnx")


def test_mnn_flavour_routes_both_kinds_of_experts_through_the_moe_op(tiny_k2_horizon, tmp_path):
    arch = open_architecture(Checkpoint.open(tiny_k2_horizon("sparse")))
    nodes = custom_nodes(arch, tmp_path / "llm.onnx")
    # FFN experts on layer_id = layer, MoVA value experts on layer_id = layers + layer
    assert sorted((m["layer_id"], m["num_experts"], m["top_k"]) for m in nodes["MoE"]) == [
        (1, 8, 2), (3, 8, 2), (5, 8, 2), (7, 8, 2)]
    main = {m["name"].decode() for m in nodes["Linear"]}
    in_templates = {spec.name for spec in arch.linears() if ".experts." in spec.name or ".v_experts." in spec.name}
    assert main == {spec.name for spec in arch.linears()} - in_templates
    assert {"model.layers.1.self_attn.v_router", "model.layers.1.mlp.gate"} <= main
    assert [t.marker for t in arch.expert_templates()] == ["@expert@", "@value_expert@"]
    ids = {(layer_id, e) for t in arch.expert_templates() for layer_id, e, _ in t.instances}
    assert len(ids) == sum(len(t.instances) for t in arch.expert_templates()) == 32  # no name clash
    assert {a["layer_index"] for a in nodes["Attention"]} == {0, 1, 2, 3}
    assert all(a["scale"] == pytest.approx(16 ** -0.5) for a in nodes["Attention"])  # 1/sqrt(head_dim)


def test_dense_mova_runs_every_value_expert_in_the_main_graph(tiny_k2_horizon, tmp_path):
    arch = open_architecture(Checkpoint.open(tiny_k2_horizon("sparse")))
    with mock.patch.object(K2Horizon, "dense_mova", True):
        nodes = custom_nodes(arch, tmp_path / "dense.onnx")
        assert [t.marker for t in arch.expert_templates()] == ["@expert@"]
    assert sorted(m["layer_id"] for m in nodes["MoE"]) == [1, 3]
    linears = {m["name"].decode() for m in nodes["Linear"]}
    assert {f"model.layers.1.self_attn.v_experts.{e}" for e in range(8)} <= linears


def test_routers_are_router_role_and_stay_fp16(tiny_k2_horizon):
    from llmexport.quant.recipes import recipe
    from llmexport.quant.scheme import QuantScheme
    from llmexport.spec import LinearRole

    arch = open_architecture(Checkpoint.open(tiny_k2_horizon("sparse")))
    plan = recipe("mlp4-attn8", QuantScheme(4, 64))
    specs = {spec.name: spec for spec in arch.linears()}
    for name in ("model.layers.1.mlp.gate", "model.layers.1.self_attn.v_router"):
        assert specs[name].role is LinearRole.ROUTER and plan.scheme_for(specs[name]).is_fp16
    assert plan.scheme_for(specs["model.layers.1.mlp.experts.0.up_proj"]).bits == 4
    assert plan.scheme_for(specs["model.layers.1.mlp.shared_experts.up_proj"]).bits == 4
    # value experts replace v_proj: attention bits, as the published 4-bit mix keeps q/k/v/o at 8
    assert plan.scheme_for(specs["model.layers.1.self_attn.v_experts.0"]).bits == 8


@pytest.mark.parametrize("edit, message", [
    (dict(drop=["model.layers.1.self_attn.v_experts.3.weight"]), "v_experts.3.weight' missing"),
    (dict(reshape={"model.layers.1.mlp.gate.e_score_correction_bias": (7,)}), r"has shape \[7\]"),
    (dict(add={"model.layers.1.self_attn.v_proj.weight": torch.zeros(32, 64)}), "not mapped"),
    (dict(config={"scoring_func": "tanh"}), "scoring_func"),
    (dict(config={"layernorm_num_groups": 3}), "not divisible"),
    (dict(config={"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}), "rope_type"),
])
def test_checkpoint_problems_are_input_errors(tiny_k2_horizon, tmp_path, edit, message):
    path = edit_checkpoint(tiny_k2_horizon("sparse"), tmp_path / "bad", **edit)
    with pytest.raises(InputError, match=message):
        open_architecture(Checkpoint.open(path))


def test_rotary_inv_freq_in_a_checkpoint_is_ignored(tiny_k2_horizon, tmp_path):
    path = edit_checkpoint(tiny_k2_horizon("dense"), tmp_path / "inv",
                            add={"model.rotary_emb.inv_freq": torch.ones(8)})
    assert open_architecture(Checkpoint.open(path)).describe().layer_kinds[0] == "0: dense"
