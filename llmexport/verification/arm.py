"""``--verify_arm``: the runtime side of verification again on MNN's ARM kernels (fp16 arithmetic,
sdot/i8mm int8 kernels), natively on an ARM host, under ``qemu-aarch64-static`` elsewhere
(llmexport/mnn/arm/machine.py).

At both precisions (``normal`` and ``low``: MNN's fp16 arithmetic, which x86 lacks, so that there
``low`` equals ``normal`` bit for bit) the shipped profile runs the single prompt teacher-forced
along the same ids as on this host, and the conversation script (conversation.py), all in ONE
child process (the emulated interpreter's start costs ~3 s). Each is judged against the same
stored-weights oracle with the same rules (``run_failures``, ``conversation_failures``). ``normal``
is judged by the export's own bounds and always counts: it proves the graph on ARM's kernels. ``low``
is judged by bounds for fp16 arithmetic (``precision_bounds``) and counts where config.json ships it;
otherwise it is reported only (what ``--precision low`` would give).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from llmexport.mnn.arm.machine import Machine
from llmexport.mnn.runtime import ChatRun, RuntimeRun, chat_call, run_calls, runtime_call
from llmexport.mnn.tokenizer.stream import StreamModel
from llmexport.models.base import Architecture
from llmexport.results import ArmCheck, ArmPrecision, Bounds, ConversationCheck, RunComparison
from llmexport.verification.conversation import ANSWER_STEPS, Conversations, conversation_failures, conversation_summary
from llmexport.verification.logits import compare_logits, run_failures

PRECISIONS = ("normal", "low")
#: one runtime thread: qemu-user runs each guest thread on a host thread, and MNN's thread pool waits
#: for its workers; measured on a tiny export under load, 2 threads loaded in 5.7 s, 1 in 0.27 s
ARM_THREADS = 1
_KERNELS = re.compile(r"(\w+):\s*(\d+)")
#: max |dlogit| of MNN's fp16 arithmetic (precision low) on ARM against the stored-weights oracle, on
#: correct exports: 0.034-0.57 on the tiny families' 16-bit exports, 0.26 on a 4-bit fast one
#: (docs/verification.md#arm-kernels); fp16 records alone reach 7e-4 (FP16_MAX_ABS_ERR's 0.005)
LOW_PRECISION_MAX_ABS_ERR = 2.0


def precision_bounds(bounds: Bounds, precision: str) -> Bounds:
    """The bounds a run at ``precision`` is judged by: fp16 arithmetic moves the logits more than
    fp16 records do, so ``low`` gets at least ``LOW_PRECISION_MAX_ABS_ERR``."""
    if precision != "low":
        return bounds
    return dataclasses.replace(bounds, max_abs_err=max(bounds.max_abs_err, LOW_PRECISION_MAX_ABS_ERR))


def shipped_precision(export_dir: Path) -> str:
    return str(json.loads((export_dir / "config.json").read_text()).get("precision", "normal"))


def precisions(shipped: str) -> tuple[str, ...]:
    """The shipped precision first, then the others of ``PRECISIONS``."""
    return (shipped,) + tuple(p for p in PRECISIONS if p != shipped)


def reported_kernels(output: list[str]) -> dict[str, int]:
    """MNN's ``The device supports: i8sdot:1, fp16:1, i8mm: 1, sve2: 1, sme2: 0`` line, as a dict."""
    for line in output:
        if line.startswith("The device supports"):
            return {name: int(value) for name, value in _KERNELS.findall(line.partition(":")[2])}
    return {}


@dataclass
class ArmRuns:
    """What the ARM child produced: per precision the single prompt's run and the conversations."""

    machine: str
    kernels: dict[str, int]
    shipped: str
    runs: dict[str, RuntimeRun]
    chats: dict[str, Conversations]


def run_on_arm(machine: Machine, export_dir: Path, prompt: list[int], forced: list[int], steps: int,
               users: list[list[str]], window: int) -> ArmRuns:
    """One child: per precision, ``prompt`` teacher-forced along ``forced`` with ``steps`` greedy ids,
    and the conversations ``users`` (the shipped profile's other config.json keys kept)."""
    shipped = shipped_precision(export_dir)
    calls: list[Any] = []
    for precision in precisions(shipped):
        config = {"thread_num": ARM_THREADS, "precision": precision}
        calls += [runtime_call(export_dir, prompt, forced, steps, config=config),
                  chat_call(export_dir, users, ANSWER_STEPS, config)]
    output: list[str] = []
    results = run_calls(calls, machine, output=output)
    runs, chats = {}, {}
    for i, precision in enumerate(precisions(shipped)):
        run, chat = results[2 * i], results[2 * i + 1]
        assert isinstance(run, RuntimeRun) and isinstance(chat, ChatRun)
        runs[precision] = run
        chats[precision] = Conversations.of(export_dir, users, window, chat)
    return ArmRuns(machine.name, reported_kernels(output), shipped, runs, chats)


def arm_check(runs: ArmRuns, host: RuntimeRun, ref_logits: np.ndarray, fp32_logits: np.ndarray,
              greedy_ref: list[int], bounds: Bounds, arch: Architecture, oracle: nn.Module, fp32: nn.Module,
              stop_ids: frozenset[int], tokenizer: Any, stream: StreamModel) -> ArmCheck:
    """Each precision judged by the verification's rules, at its own bounds (``precision_bounds``;
    which failures fail the export: ``arm_failures``)."""
    reports = []
    for precision, run in runs.runs.items():
        chat = runs.chats[precision]
        chat.add_oracle(arch, oracle, stop_ids)
        chat.add_fp32(arch, fp32)
        conversation = chat.check(tokenizer, stream)
        oracle_stats = RunComparison.of(compare_logits(run.forced_logits, ref_logits), greedy_ref, run.greedy_ids)
        label = f"ARM precision {precision}: "
        judged = precision_bounds(bounds, precision)
        failures = run_failures(label, oracle_stats, judged.max_abs_err, judged.mean_abs_err) + [
            label + f for f in conversation_failures(conversation, judged.max_abs_err, judged.mean_abs_err, None)]
        vs_host = float(np.abs(run.forced_logits - host.forced_logits).max())
        reports.append(ArmPrecision(precision, precision == runs.shipped, oracle_stats,
                                    compare_logits(run.forced_logits, fp32_logits), vs_host, conversation,
                                    tuple(failures), judged.max_abs_err))
    return ArmCheck(runs.machine, runs.kernels, tuple(reports))


def counts(run: ArmPrecision) -> bool:
    """Whether a precision's failures fail the export: ``normal`` always (the graph on ARM's
    kernels), ``low`` where it is shipped."""
    return run.shipped or run.precision == "normal"


def arm_failures(check: ArmCheck) -> tuple[str, ...]:
    """The failures that fail the export (``counts``)."""
    return tuple(f for run in check.runs if counts(run) for f in run.failures)


def arm_summary(check: ArmCheck) -> str:
    kernels = ", ".join(f"{k} {v}" for k, v in check.kernels.items() if k in ("fp16", "i8sdot", "i8mm"))
    parts = []
    for run in check.runs:
        verdict = ("PASS" if not run.failures else "FAIL") if counts(run) else "reported only"
        parts.append(f"precision {run.precision}{' (shipped)' if run.shipped else ''} ({verdict}): top-1 "
                     f"{run.oracle.top1_agreement:.0%}, max |dlogit| {run.oracle.max_abs_err:.2e} (bound {run.bound}, "
                     f"x86 {run.vs_host_max_abs_err:.2e}), "
                     + _short(run.conversation))
    return f"ARM {check.machine} [{kernels}]: " + "; ".join(parts)


def _short(conversation: ConversationCheck) -> str:
    return conversation_summary(conversation).split(", prompt ids")[0] + (
        f", top-1 {conversation.top1_agreement:.0%}, max |dlogit| {conversation.max_abs_err:.2e}")
