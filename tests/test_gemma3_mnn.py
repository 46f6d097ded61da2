"""Gemma3 text exports run by MNN's runtime next to transformers in fp32 (sliding window shorter
than the prompts, two RoPE bases, query_pre_attn_scalar, (1 + weight) norms), a 4-bit export
and ``--verify`` on the command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_decoder_families_mnn import _assert_agrees

from llmexport import ExportOptions, export
from llmexport.quant.scheme import QuantScheme
from llmexport.tiny.gemma3 import VARIANTS
from llmexport.verification.verify import summary_line, verify_export

from families import parametrize


@pytest.mark.slow
@parametrize("mnn", "variant", sorted(VARIANTS), "gemma3_text")
def test_fp16_export_agrees_with_fp32_reference(tiny_gemma3, tmp_path, variant):
    path, out = tiny_gemma3(variant), tmp_path / "out"
    export(path, out, ExportOptions(quant=QuantScheme(16, 64)))
    report = verify_export(out, path, steps=24)
    print(f"\ngemma3 {variant} q16: {summary_line(report)}")
    _assert_agrees(report, 24)
    assert report.oracle.top1_agreement == report.fp32.top1_agreement == 1.0
    assert report.oracle.max_abs_err < 0.005 and report.fp32.max_abs_err < 0.005
    assert len(set(report.oracle.greedy_ref)) > 3  # decoding is not stuck on one token
    config = json.loads((out / "llm_config.json").read_text())
    assert config["attention_type"] == ("full" if variant == "full" else "mix")


@pytest.mark.slow
def test_4bit_export_verifies(tiny_gemma3, tmp_path):
    path, out = tiny_gemma3("1b"), tmp_path / "q4"
    export(path, out, ExportOptions(quant=QuantScheme(4, 64)))
    report = verify_export(out, path, steps=12)
    print(f"\ngemma3 1b q4: {summary_line(report)}")
    assert report.passed, report.failures


@pytest.mark.slow
def test_cli_verify_on_gemma3(tiny_gemma3, tmp_path):
    dst = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", "from llmexport.cli import main; main()", "--path",
                           str(tiny_gemma3("scaled")), "--dst_path", str(dst), "--quant_bit", "8", "--verify"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "verify: PASS" in proc.stdout
    assert json.loads((dst / "verify.json").read_text())["passed"]
