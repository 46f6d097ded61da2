"""K2-Horizon exports run by MNN's runtime next to the reference (remote code) in fp32.

The tiny checkpoints are bf16, as the family ships, so a 16-bit export stores their weights
exactly: the runtime is held to both the stored-weights oracle and the unmodified fp32 reference.
"""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest

from llmexport import ExportOptions, export
from llmexport.mnn.convert import mnn_to_json
from llmexport.mnn.readback import linear_records
from llmexport.models.k2_horizon.family import K2Horizon
from llmexport.quant.recipes import recipe
from llmexport.quant.scheme import QuantScheme
from llmexport.results import VerifyReport
from llmexport.tiny.k2_horizon import build_k2_horizon_checkpoint, random_config
from llmexport.verification.verify import summary_line, verify_export

from families import parametrize

VARIANTS = ("dense", "sparse", "sparse-qknorm")


def _export_and_verify(checkpoint: Path, out: Path, options: ExportOptions, dense_mova: bool = False,
                       steps: int = 24) -> dict:
    with mock.patch.object(K2Horizon, "dense_mova", dense_mova):
        export(checkpoint, out, options)
    return verify_export(out, checkpoint, steps=steps, trust_remote_code=True)


def _subgraphs(out: Path, tmp: Path) -> set[str]:
    return {sub["name"] for sub in mnn_to_json(out / "llm.mnn", tmp / "graph.json").get("subgraphs", [])}


def _assert_agrees(report: VerifyReport, steps: int = 24) -> None:
    for section, stats in (("oracle", report.oracle), ("fp32", report.fp32)):
        for step in stats.per_step:  # top-1 everywhere, unless the reference itself is a near-tie
            assert not step.flipped, (section, step)
        assert stats.max_abs_err < 0.1, section
    oracle = report.oracle
    assert len(oracle.greedy_mnn) == steps and oracle.greedy_ref == oracle.greedy_mnn
    assert report.tokenizer.agree
    assert report.passed, report.failures


@pytest.mark.slow
@parametrize("mnn", "variant", VARIANTS, "k2_horizon")
def test_fp16_export_agrees_with_fp32_reference(tiny_k2_horizon, tmp_path, variant):
    out = tmp_path / "out"
    report = _export_and_verify(tiny_k2_horizon(variant), out, ExportOptions(quant=QuantScheme(16, 64)))
    print(f"\n{variant} q16: {summary_line(report)}")
    _assert_agrees(report)
    assert report.oracle.top1_agreement == report.fp32.top1_agreement == 1.0
    assert len(set(report.oracle.greedy_ref)) > 3  # decoding is not stuck on one token
    llm_config = json.loads((out / "llm_config.json").read_text())
    assert llm_config["attention_type"] == "full" and "sliding_window" not in llm_config
    assert "attn_scale" not in llm_config  # runtime default 1/sqrt(head_dim) is the family's
    assert llm_config["jinja"]["bos"] == "<bos>" and "<|turn>" in llm_config["jinja"]["chat_template"]
    assert json.loads((out / "config.json").read_text())["precision"] == "normal"
    subgraphs = _subgraphs(out, tmp_path)
    if variant == "dense":
        assert not subgraphs
    else:  # FFN experts of layers 1, 3 as /expert/{1,3}_e; MoVA value experts as /expert/{5,7}_e
        assert {name.rsplit("_", 1)[0] for name in subgraphs} == {"/expert/1", "/expert/3", "/expert/5",
                                                                  "/expert/7"}


@pytest.mark.slow
def test_dense_mova_export_computes_the_same(tiny_k2_horizon, tmp_path):
    """The benchmark's baseline (every value expert in the main graph) is the same function."""
    out = tmp_path / "dense"
    report = _export_and_verify(tiny_k2_horizon("sparse"), out, ExportOptions(quant=QuantScheme(16, 64)),
                                dense_mova=True, steps=12)
    _assert_agrees(report, steps=12)
    assert {name.rsplit("_", 1)[0] for name in _subgraphs(out, tmp_path)} == {"/expert/1", "/expert/3"}
    assert "model.layers.1.self_attn.v_experts.7" in linear_records(out)


@pytest.mark.slow
def test_mlp4_attn8_recipe_export(tiny_k2_horizon, tmp_path):
    out = tmp_path / "q"
    options = ExportOptions().with_plan(recipe("mlp4-attn8", QuantScheme(4, 64)))
    report = _export_and_verify(tiny_k2_horizon("sparse-qknorm"), out, options, steps=12)
    print(f"\nsparse-qknorm mlp4-attn8: {summary_line(report)}")
    assert report.passed, report.failures
    assert report.exact_kernels.max_abs_err < 0.2
    records = linear_records(out)
    bits = {name: rec["quanParameter"].get("aMaxOrBits") for name, rec in records.items()}
    # routers stay fp16 records (quanParameter type 3), as the published 4-bit mix keeps them in floats
    for router in ("model.layers.1.mlp.gate", "model.layers.1.self_attn.v_router"):
        assert records[router]["quanParameter"]["type"] == 3
    assert bits["model.layers.1.self_attn.v_experts.0"] == bits["model.layers.1.self_attn.q_proj"] == 8
    assert bits["model.layers.1.mlp.experts.0.down_proj"] == bits["model.layers.0.mlp.up_proj"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("seed", [204, 208])
def test_random_variant_runs_in_mnn(tmp_path, seed):
    path = build_k2_horizon_checkpoint(tmp_path / "model", random_config(seed), seed=seed)
    report = _export_and_verify(path, tmp_path / "out", ExportOptions(quant=QuantScheme(16, 64)), steps=12)
    _assert_agrees(report, steps=12)
