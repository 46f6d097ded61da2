"""Phi-3 / Phi-4-mini exports run by MNN's runtime next to transformers in fp32 (fused qkv and
gate_up, partial rotary, longrope's short factors and attention factor)."""

from __future__ import annotations

import pytest
from test_decoder_families_mnn import _assert_agrees

from llmexport import ExportOptions, export
from llmexport.quant.scheme import QuantScheme
from llmexport.tiny.phi3 import VARIANTS
from llmexport.verification.verify import summary_line, verify_export

from families import parametrize


@pytest.mark.slow
@parametrize("mnn", "variant", sorted(VARIANTS), "phi3")
def test_fp16_export_agrees_with_fp32_reference(tiny_phi3, tmp_path, variant):
    path, out = tiny_phi3(variant), tmp_path / "out"
    export(path, out, ExportOptions(quant=QuantScheme(16, 64)))
    report = verify_export(out, path, steps=24)
    print(f"\nphi3 {variant} q16: {summary_line(report)}")
    _assert_agrees(report, 24)
    assert report.oracle.top1_agreement == report.fp32.top1_agreement == 1.0
    assert report.oracle.max_abs_err < 0.005 and report.fp32.max_abs_err < 0.005
