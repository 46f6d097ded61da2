"""A finished export is never thrown away because its verification could not run.

Out of memory, a crashed or hung runtime child: the export is swapped into --dst_path all the
same, verify.json says why nothing was verified, and the exit code (7) says "exported, not
verified" -- distinct from a verification that ran and disagreed (4, the export discarded).
"""

from __future__ import annotations

import json
import subprocess

import pytest
from click.testing import CliRunner

import llmexport.verification as verification
from llmexport.cli import main
from llmexport.errors import ConversionError, NotVerified, VerificationFailed
from llmexport.results import VerifyReport


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
