"""A finished export is never thrown away because its verification could not run.

Out of memory, a crashed or hung runtime child: the export is swapped into --dst_path all the
same, verify.json says why nothing was verified, and the exit code (7) says "exported, not
verified" -- distinct from a verification that ran and disagreed (4, the export discarded, or
kept with --keep_failed).
"""

from __future__ import annotations

import json
import subprocess

import pytest
from click.testing import CliRunner

import llmexport.verification.verify as verification
from llmexport.cli import main
from llmexport.errors import ConversionError, NotVerified, VerificationFailed
from llmexport.mnn.config import RuntimeProfile
from llmexport.results import Bounds, LogitStats, RunComparison, StepStats, TokenizerCheck, VerifyReport


def _raiser(exc: BaseException):
    def verify_export(*args, **kwargs):
        raise exc
    return verify_export


@pytest.mark.parametrize("exc", [
    MemoryError("Unable to allocate 10.0 GiB for an array with shape (671088640, 4) and data type int32"),
    ConversionError("MNN runtime failed on out (exit -11):\nSegmentation fault"),
    subprocess.TimeoutExpired(["python", "-m", "llmexport.mnn.runtime"], 600),
])
def test_export_is_kept_when_verification_cannot_run(tiny_decoder, tmp_path, monkeypatch, exc):
    monkeypatch.setattr(verification, "verify_export", _raiser(exc))
    dst = tmp_path / "out"
    result = CliRunner().invoke(main, ["--path", str(tiny_decoder("llama3")), "--dst_path", str(dst),
                                       "--quant_bit", "16", "--verify"])
    assert result.exit_code == NotVerified.exit_code == 7, result.output
    assert f"exported to {dst}, but --verify could not run ({type(exc).__name__}" in result.output
    assert {"llm.mnn", "llm.mnn.weight", "config.json", "manifest.json"} <= {p.name for p in dst.iterdir()}
    report = json.loads((dst / "verify.json").read_text())
    assert report["ran"] is False and report["passed"] is False and report["error"].startswith(type(exc).__name__)
    assert "\n" not in report["error"]  # one line
    with pytest.raises(ValueError, match="the verification did not run: " + type(exc).__name__):
        VerifyReport.read(dst / "verify.json")
    # the manifest lists what was kept, verify.json included
    assert "verify.json" in json.loads((dst / "manifest.json").read_text())["files"]


def test_a_verification_that_disagrees_still_discards_the_export(tiny_decoder, tmp_path, monkeypatch):
    monkeypatch.setattr(verification, "verify_export", _raiser(VerificationFailed("out: verification failed: x")))
    dst = tmp_path / "out"
    result = CliRunner().invoke(main, ["--path", str(tiny_decoder("llama3")), "--dst_path", str(dst),
                                       "--quant_bit", "16", "--verify"])
    assert result.exit_code == 4 and "verification failed" in result.output
    assert not dst.exists()


_FAILURE = "step 0: top-1 3 != 4 (gap 0.5000 > the 0.2000 its two logits moved)"


def _disagreeing(export_dir, model_path, raise_on_failure=False, **kwargs) -> VerifyReport:
    """verify_export whose verification ran and disagreed: verify.json written, then raised unless
    the caller keeps the report (``raise_on_failure=False``)."""
    step = StepStats(1.5, 0.5, 0.5, False, 3, 4, 0.5, 0.2)
    stats = LogitStats(0.0, 1.5, 0.5, (step,))
    report = VerifyReport(40, 1, TokenizerCheck(True, 7, ()), RuntimeProfile.EXACT, RunComparison.of(stats, [4], [3]),
                          stats, Bounds("exact", 0.2), (_FAILURE,))
    (export_dir / "verify.json").write_text(json.dumps(report.to_json(), indent=2))
    if raise_on_failure:
        raise VerificationFailed(f"{export_dir}: verification failed: {_FAILURE}")
    return report


@pytest.mark.parametrize("keep", [False, True])
def test_keep_failed_keeps_an_export_whose_verification_disagreed(tiny_decoder, tmp_path, monkeypatch, keep):
    monkeypatch.setattr(verification, "verify_export", _disagreeing)
    dst = tmp_path / "out"
    result = CliRunner().invoke(main, ["--path", str(tiny_decoder("llama3")), "--dst_path", str(dst),
                                       "--quant_bit", "16", "--verify"] + (["--keep_failed"] if keep else []))
    assert result.exit_code == VerificationFailed.exit_code == 4, result.output
    assert _FAILURE in result.output
    if not keep:
        assert not dst.exists() and list(tmp_path.iterdir()) == []
        return
    assert f"exported to {dst} (--keep_failed), but verification failed: {_FAILURE}" in result.output
    kept = {p.name for p in dst.iterdir()}
    assert {"llm.mnn", "llm.mnn.weight", "config.json", "manifest.json", "verify.json"} <= kept
    report = VerifyReport.read(dst / "verify.json")
    assert not report.passed and report.failures == (_FAILURE,)
    assert json.loads((dst / "verify.json").read_text())["passed"] is False
    assert "verify.json" in json.loads((dst / "manifest.json").read_text())["files"]


@pytest.mark.slow
def test_exact_kernels_runs_are_skipped_where_they_do_not_fit(tiny_gemma4, tmp_path, monkeypatch):
    """MNN's exact kernels hold every linear in fp32 (an E4B-shaped export: 20.5 GiB). Where that does
    not fit, a fast export is verified on its shipped kernels alone, and the report says what was left
    out and why; the multimodal model's media prompts (run on the exact kernels) likewise."""
    import llmexport.planning.memory_plan as memory_plan
    from llmexport import ExportOptions, export
    from llmexport.quant.scheme import QuantScheme

    out = tmp_path / "out"
    export(tiny_gemma4("e2b"), out, ExportOptions(quant=QuantScheme(4, 64)))
    monkeypatch.setattr(memory_plan, "available_bytes", lambda: 1 << 20)
    report = verification.verify_export(out, tiny_gemma4("e2b"), steps=8)
    assert report.exact_kernels is None and report.bounds.kernels_max_abs_err is None
    assert report.skipped[0].startswith("exact-kernels runs: needs about ") and "1.0 MiB" not in report.skipped[0]
    assert "0.0 GiB available" in report.skipped[0]
    assert all(turn.exact_kernels is None for turn in report.conversation.turns)
    assert VerifyReport.read(out / "verify.json").skipped == report.skipped
    assert "SKIPPED exact-kernels runs" in verification.summary_line(report)
