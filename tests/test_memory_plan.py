"""Memory is a planned resource: the plan estimates the peak of the export and of --verify, a run
that would not fit is refused before any heavy stage (exit 8), and memory running out during a
stage is the same one-line resource error, never an internal error."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

import llmexport
import llmexport.mnn.embeddings as embeddings
import llmexport.pipeline as pipeline
import llmexport.targets.mnn_target as mnn_target
from llmexport.cli import main
from llmexport.errors import ResourceError
from llmexport.options import ExportOptions
from llmexport.planning.memory_plan import GIB, MIB, available_bytes, gib
from llmexport.results import ExportPlan, MemoryPlan


def _lines(output: str) -> list[str]:
    return [line for line in output.strip().splitlines() if not line.startswith(("INFO", "WARNING"))]


def _nothing_written(tmp_path, dst) -> bool:
    """No --dst_path, and nothing the run left beside it (staging folder, lock)."""
    return not dst.exists() and [p.name for p in tmp_path.iterdir()] == []


def test_the_plan_holds_the_expected_peaks_and_the_dry_run_prints_them(tiny_decoder):
    path = tiny_decoder("llama3")
    plan = llmexport.plan(path, ExportOptions(verify=True))
    memory = plan.memory
    assert isinstance(memory, MemoryPlan) and memory.verify_bytes is not None
    assert 256 * MIB < memory.export_bytes < 1 * GIB and memory.verify_bytes > 0
    data = json.loads(json.dumps(plan.to_json()))
    assert data["memory"] == {"export_bytes": memory.export_bytes, "verify_bytes": memory.verify_bytes,
                              "exact_kernels_bytes": memory.exact_kernels_bytes}
    assert ExportPlan.from_json(data) == plan
    assert llmexport.plan(path).memory == MemoryPlan(memory.export_bytes, None)  # no --verify: no estimate

    result = CliRunner().invoke(main, ["--path", str(path), "--dst_path", "unused", "--dry-run", "--verify"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert memory.exact_kernels_bytes is not None  # a fast 4-bit export: its exact-kernels run is optional
    assert (f"expected peak memory: export {gib(memory.export_bytes)}, --verify {gib(memory.verify_bytes)} (its run "
            f"on MNN's exact kernels {gib(memory.exact_kernels_bytes)}, skipped where it does not fit)") in lines
    assert lines[-1].startswith("memory: ") and lines[-1].endswith(" GiB available; fits")

    result = CliRunner().invoke(main, ["--path", str(path), "--dst_path", "unused", "--dry-run",
                                       "--max_memory", "0.001"])
    assert result.exit_code == 0 and result.stdout.splitlines()[-1].startswith(
        "memory: 0.0 GiB allowed by --max_memory; would be refused: the export needs about")


def test_an_export_that_would_not_fit_is_refused_before_it_starts(tiny_decoder, tmp_path, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("a heavy stage ran")

    monkeypatch.setattr(mnn_target.MnnTarget, "write", never)
    dst = tmp_path / "out"
    path = tiny_decoder("llama3")
    result = CliRunner().invoke(main, ["--path", str(path), "--dst_path", str(dst), "--max_memory", "0.001"])
    assert result.exit_code == ResourceError.exit_code == 8, result.output
    export = llmexport.plan(path).memory.export_bytes
    assert _lines(result.output) == [
        f"llmexport: error: the export needs about {gib(export)} of memory, 0.0 GiB allowed by --max_memory; "
        "free memory or run on a larger machine (--max_memory GIB overrides the check)"]
    assert _nothing_written(tmp_path, dst)


def test_a_verification_that_would_not_fit_is_refused_before_the_export(tiny_decoder, tmp_path, monkeypatch):
    path = tiny_decoder("llama3")
    memory = llmexport.plan(path, ExportOptions(verify=True)).memory
    if memory.verify_bytes <= memory.export_bytes:
        pytest.skip("the verification's estimate is not above the export's")
    monkeypatch.setattr(mnn_target.MnnTarget, "write", lambda *args: pytest.fail("a heavy stage ran"))
    limit = (memory.export_bytes + memory.verify_bytes) / 2 / GIB
    dst = tmp_path / "out"
    result = CliRunner().invoke(main, ["--path", str(path), "--dst_path", str(dst), "--verify",
                                       "--max_memory", str(limit)])
    assert result.exit_code == 8, result.output
    assert _lines(result.output) == [
        f"llmexport: error: --verify needs about {gib(memory.verify_bytes)} of memory, {gib(int(limit * GIB))} "
        "allowed by --max_memory; run without --verify or on a larger machine (--max_memory GIB overrides the check)"]
    assert _nothing_written(tmp_path, dst)


def test_available_memory_is_measured():
    assert 0 < available_bytes()


_MEASURE = """
import resource, subprocess, sys
subprocess.run([sys.executable, "-c", "from llmexport.cli import main; main()", *sys.argv[1:]], check=True)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)  # KiB on Linux
"""


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss is in KiB on Linux only")
def test_the_estimate_bounds_the_measured_peak_of_a_tiny_export(tiny_decoder, tmp_path):
    """The export runs in a child of a small wrapper, whose RUSAGE_CHILDREN peak is the export's
    own (or a converter child's, which starts as a fork of it: never more)."""
    path = tiny_decoder("llama3")
    flags = ["--path", str(path), "--dst_path", str(tmp_path / "out"), "--quiet"]
    proc = subprocess.run([sys.executable, "-c", _MEASURE, *flags], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    measured = int(proc.stdout.split()[-1])
    estimate = llmexport.plan(path).memory.export_bytes
    assert measured <= estimate, f"measured {measured / MIB:.0f} MiB, estimated {estimate / MIB:.0f} MiB"


@pytest.mark.parametrize("exc, message", [
    (MemoryError("Unable to allocate 10.0 GiB for an array with shape (671088640, 4) and data type int32"),
     "out of memory during the embeddings stage: Unable to allocate 10.0 GiB for an array with shape "
     "(671088640, 4) and data type int32"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                  "tried to allocate 1073741824 bytes. Error code 12 (Cannot allocate memory)"),
     "out of memory during the embeddings stage: DefaultCPUAllocator: can't allocate memory: you tried to allocate "
     "1073741824 bytes. Error code 12 (Cannot allocate memory)"),
    (MemoryError(), "out of memory during the embeddings stage"),
])
def test_memory_running_out_in_a_stage_is_a_resource_error(tiny_decoder, tmp_path, monkeypatch, exc, message):
    def write_embedding_table(*args, **kwargs):  # on the token table's own thread, raised in its stage
        raise exc

    monkeypatch.setattr(embeddings, "write_embedding_table", write_embedding_table)
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "previous.txt").write_text("old export")
    result = CliRunner().invoke(main, ["--path", str(tiny_decoder("llama3")), "--dst_path", str(dst),
                                       "--quant_bit", "16"])
    assert result.exit_code == 8, result.output
    assert _lines(result.output)[-1] == f"llmexport: error: {message}"
    assert "internal error" not in result.output
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and [p.name for p in dst.iterdir()] == ["previous.txt"]


def test_memory_running_out_outside_a_stage_is_a_resource_error(tiny_decoder, tmp_path, monkeypatch):
    def plan(*args):
        raise MemoryError("Unable to allocate 2.0 GiB")

    monkeypatch.setattr(pipeline, "export_plan", plan)
    dst = tmp_path / "out"
    result = CliRunner().invoke(main, ["--path", str(tiny_decoder("llama3")), "--dst_path", str(dst)])
    assert result.exit_code == 8, result.output
    assert _lines(result.output) == ["llmexport: error: out of memory during the export: Unable to allocate 2.0 GiB"]
    assert _nothing_written(tmp_path, dst)


def test_other_runtime_errors_stay_internal_errors(tiny_decoder, tmp_path, monkeypatch):
    def write_embedding_table(*args, **kwargs):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(embeddings, "write_embedding_table", write_embedding_table)
    result = CliRunner().invoke(main, ["--path", str(tiny_decoder("llama3")), "--dst_path", str(tmp_path / "out")])
    assert result.exit_code == 1 and "internal error: RuntimeError: shape mismatch" in result.output


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss is in KiB on Linux only")
@pytest.mark.parametrize("variant", ["llama3", "qwen3-moe-mixed"])
def test_the_estimate_bounds_a_calibrated_export(tiny_decoder, tmp_path, variant):
    from llmexport.options import Calibration
    from llmexport.tiny.byte_level_tokenizer import EXTRA_CORPUS
    from llmexport.tiny.tokenizer import TRAINING_CORPUS

    text = tmp_path / "calibration.txt"
    text.write_text((TRAINING_CORPUS + EXTRA_CORPUS) * 4, encoding="utf-8")
    path = tiny_decoder(variant)
    flags = ["--path", str(path), "--dst_path", str(tmp_path / "out"), "--quiet", "--calib_data", str(text),
             "--calib_samples", "16", "--calib_seq_len", "128"]
    proc = subprocess.run([sys.executable, "-c", _MEASURE, *flags], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    measured = int(proc.stdout.split()[-1])
    plain = llmexport.plan(path).memory.export_bytes
    estimate = llmexport.plan(path, ExportOptions(calibration=Calibration(text, 16, 128))).memory.export_bytes
    assert plain < estimate and measured <= estimate, \
        f"measured {measured / MIB:.0f} MiB, estimated {estimate / MIB:.0f} MiB (without calibration {plain / MIB:.0f})"
