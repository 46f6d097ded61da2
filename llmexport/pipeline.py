"""The export, in order, writing into a staging folder.

HF folder -> Architecture -> every scheme decided (llmexport/planning/schemes.py) -> the plan and its
memory check -> the target of ``--export`` writes its files (llmexport/targets/: MNN or ONNX)
-> ``--verify`` -> manifest.json.
"""

from __future__ import annotations

import json
import logging
import subprocess
import time
from pathlib import Path
from typing import Any

from llmexport.errors import ConversionError, ResourceError, UsageError
from llmexport.mnn.arm.machine import Machine, arm_machine
from llmexport.models.base import Architecture
from llmexport.options import ExportOptions
from llmexport.planning.digests import FileDigests
from llmexport.planning.export_plan import export_plan, write_manifest
from llmexport.planning.memory_plan import check_fits
from llmexport.planning.schemes import Schemes
from llmexport.results import ExportPlan, ExportResult, VerifyReport
from llmexport.source.checkpoint import Checkpoint
from llmexport.source.loading import open_architecture
from llmexport.source.lora import adapter_of
from llmexport.targets import ExportJob, OutputTarget, stage, target_for

log = logging.getLogger(__name__)


def _load(path: Path, options: ExportOptions, target: OutputTarget) -> tuple[Checkpoint, Architecture, Any]:
    """Open and check everything the export reads before any heavy work: config, weights'
    headers, the architecture, what the target needs (the tokenizer, converted in memory), the
    verification's needs."""
    checkpoint = Checkpoint.open(path)
    arch = open_architecture(checkpoint, options.lora)
    prepared = target.prepare(checkpoint, arch, options)
    runs_reference = [flag for flag, on in (("--verify", options.verify),
                                            ("--calib_data", options.calibration is not None)) if on]
    if runs_reference and arch.reference_is_remote_code and not options.trust_remote_code:
        raise UsageError(f"{runs_reference[0]}: the {arch.describe().family} reference model is the checkpoint's own "
                         f"code ({', '.join(sorted(p.name for p in path.glob('*.py'))) or 'auto_map'}); pass "
                         "--trust_remote_code to allow running it")
    return checkpoint, arch, prepared


def run_export(path: Path, out: Path, options: ExportOptions, source: dict[str, Any] | None = None) -> ExportResult:
    """The export of the checkpoint folder ``path`` into ``out``; ``source``: where the folder came
    from (a hub repo and commit, llmexport.source.hub), recorded in manifest.json."""
    timings: dict[str, float] = {}
    start = time.perf_counter()
    target = target_for(options.export)
    _, arch, prepared = _load(path, options, target)  # reading only: input errors, never output errors
    # --verify_arm: a missing emulator or a failed set-up of the ARM runtime is refused before anything is written
    arm = arm_machine() if options.verify and options.verify_arm and target.verifiable else None
    graph = arch.build_graph()
    schemes = Schemes(arch, options, target.record_bytes)
    timings["load"] = round(time.perf_counter() - start, 3)
    plan = export_plan(arch, options, schemes, target)
    assert plan.memory is not None  # export_plan estimates it
    check_fits(plan.memory, options.max_memory)  # before any heavy stage
    for adjusted in plan.adjusted_blocks:
        log.info("block %d does not divide %s (width %d): using %d", adjusted.requested, adjusted.name,
                 adjusted.in_features, adjusted.used)
    digests = FileDigests()
    target.write(ExportJob(arch, graph, options, schemes, out, prepared, timings, digests))
    verification: VerifyReport | None = None
    verify_error: str | None = None
    if options.verify and target.verifiable:
        with stage(timings, "verify"):
            verification, verify_error = _verify(out, path, options, arm)
    with stage(timings, "manifest"):
        write_manifest(out, options, plan, digests, adapter_of(arch.checkpoint.weights), source)
    return ExportResult(out, tuple(sorted(p.name for p in out.iterdir())), plan, timings, verification, verify_error)


#: what stops a verification from running without saying anything about the export: resources
#: (also torch's allocator failing: ResourceError.out_of_memory), the runtime crashing or timing out
#: on it (MNN's runtime runs in child processes)
_VERIFY_CANNOT_RUN = (MemoryError, ConversionError, subprocess.TimeoutExpired)


def _verify(out: Path, path: Path, options: ExportOptions,
            arm: Machine | None = None) -> tuple[VerifyReport | None, str | None]:
    """The verification report, or why it could not run: a finished export is never discarded
    for that (verify.json records the reason); a verification that ran and disagreed raises,
    unless ``keep_failed`` (then the failing report comes back and the export is kept)."""
    from llmexport.verification.verify import verify_export

    try:
        return verify_export(out, path, raise_on_failure=not options.keep_failed,
                             trust_remote_code=options.trust_remote_code,
                             approximate_ignore_merges=options.approximate_ignore_merges,
                             text=options.verify_text, lora=options.lora, arm=arm), None
    except Exception as exc:
        if not isinstance(exc, _VERIFY_CANNOT_RUN) and ResourceError.out_of_memory(exc, "") is None:
            raise
        reason = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
        log.warning("verify could not run: %s", reason)
        (out / "verify.json").write_text(json.dumps({"ran": False, "error": reason, "passed": False}, indent=2))
        return None, reason


def dry_run(path: Path, options: ExportOptions) -> ExportPlan:
    """The plan of an export, computed without writing anything (after the same input checks)."""
    target = target_for(options.export)
    _, arch, _ = _load(path, options, target)
    return export_plan(arch, options, Schemes(arch, options, target.record_bytes), target)
