"""Manifest, reproducibility and the dry-run plan."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

import llmexport
from llmexport import ExportOptions
from llmexport.planning.export_plan import plan_summary
from llmexport.quant.scheme import QuantScheme
from llmexport.spec import LinearRole


@pytest.mark.slow
def test_two_exports_are_byte_identical_and_manifest_hashes_match(tiny_gemma4, tmp_path):
    outs = []
    for seed in ("1", "2"):  # different hash seeds: no set/dict order may leak into the files
        out = tmp_path / f"out{seed}"
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run([sys.executable, "-c", "from llmexport.cli import main; main()", "--path",
                               str(tiny_gemma4("26b-a4b")), "--dst_path", str(out), "--quiet"],
                              env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-1500:]
        outs.append(out)
    names = sorted(p.name for p in outs[0].iterdir())
    assert names == sorted(p.name for p in outs[1].iterdir())
    for name in names:
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    manifest = json.loads((outs[0] / "manifest.json").read_text())
    for name, info in manifest["files"].items():
        data = (outs[0] / name).read_bytes()
        assert info["sha256"] == hashlib.sha256(data).hexdigest() and info["bytes"] == len(data)
    assert set(manifest["versions"]) >= {"llmexport", "torch", "transformers", "MNN"}
    assert manifest["architecture"]["family"] == "gemma4" and manifest["options"]["quant"]["bits"] == 4


@pytest.mark.parametrize("shape, options", [
    ("e2b", ExportOptions()),
    ("31b", ExportOptions(quant=QuantScheme(8, 32), embed_bit=8)),
    ("26b-a4b", ExportOptions(quant=QuantScheme(16))),
])
def test_plan_estimates_the_exact_size(tiny_gemma4, tmp_path, shape, options):
    plan = llmexport.plan(tiny_gemma4(shape), options)
    llmexport.export(tiny_gemma4(shape), tmp_path / "out", options)
    written = sum(p.stat().st_size for p in (tmp_path / "out").iterdir()
                  if p.name == "llm.mnn.weight" or p.name.endswith(".bin"))
    assert plan.estimated_bytes == written


def test_plan_lists_adjusted_blocks(tiny_gemma4):
    plan = llmexport.plan(tiny_gemma4("e2b"), ExportOptions(quant=QuantScheme(4, 64)))
    adjusted = {a.name: a.used for a in plan.adjusted_blocks}
    assert adjusted["model.language_model.layers.0.mlp.down_proj"] == 48  # width 96
    assert adjusted["model.language_model.layers.0.per_layer_projection"] == 16  # width 16 < block
    assert all(linear.block > 0 for linear in plan.linears)


def test_dry_run_writes_nothing(tiny_gemma4, tmp_path):
    from click.testing import CliRunner

    from llmexport.cli import main

    result = CliRunner().invoke(main, ["--path", str(tiny_gemma4("e2b")), "--dst_path", str(tmp_path / "x"),
                                       "--dry-run", "--quant_config", "mlp4-attn8"])
    assert result.exit_code == 0, result.output
    assert "layer 7: full kv<-2 head_dim=32" in result.output
    assert "mlp: 4 bits, block 32" in result.output and "estimated size" in result.output
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("family, shape", [("gemma4", "26b-a4b"), ("k2", "sparse"), ("decoder", "qwen3-moe")])
@pytest.mark.parametrize("flags", [[], ["--quant_config", "mlp4-attn8"], ["--quant_bit", "4", "--quant_block", "64"]])
def test_dry_run_shows_routers_fp16(tiny_gemma4, tiny_k2_horizon, tiny_decoder, tmp_path, family, shape, flags):
    """Routers stay fp16 under the default scheme and every recipe, and the plan says so."""
    from click.testing import CliRunner

    from llmexport.cli import main

    path = {"gemma4": tiny_gemma4, "k2": tiny_k2_horizon, "decoder": tiny_decoder}[family](shape)
    routers = [linear for linear in llmexport.plan(path, ExportOptions()).linears if linear.role is LinearRole.ROUTER]
    assert routers and {linear.bits for linear in routers} == {16}
    result = CliRunner().invoke(main, ["--path", str(path), "--dst_path", str(tmp_path / "x"), "--dry-run", *flags])
    assert result.exit_code == 0, result.output
    assert f"router: fp16 (not quantized) x {len(routers)}" in result.output, result.output


def test_plan_lists_the_towers_with_their_schemes_and_record_bytes(tmp_path):
    """The towers' linears are planned by the same schemes module as the text's (--visual_quant_bit,
    --audio_quant_bit) and their record bytes are the ones written to {tower}.mnn.weight."""
    from llmexport.mnn.readback import linear_records
    from llmexport.tiny.gemma4_towers import build_tiny_multimodal

    path = build_tiny_multimodal(tmp_path / "ckpt", "vision-audio-64")
    options = ExportOptions(visual_quant_bit=4, audio_quant_bit=8)
    plan = llmexport.plan(path, options)
    assert set(plan.towers) == {"visual", "audio"}
    result = llmexport.export(path, tmp_path / "out", options)
    for name, bits in (("visual", 4), ("audio", 8)):
        tower = plan.towers[name]
        assert tower.linears and {linear.bits for linear in tower.linears} == {bits}
        records = linear_records(result.dst, name, {linear.name for linear in tower.linears})
        assert set(records) == {linear.name for linear in tower.linears}
        assert tower.record_bytes == sum(sum(r["external"][1:4]) for r in records.values())
    assert "tower visual: " in plan_summary(plan) and "tower audio: " in plan_summary(plan)
