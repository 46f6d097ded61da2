"""Media prompts: MNN's runtime through its normal call path vs HF's full model called as a user
calls it, for the ``PromptCase``s of a ``TowerCheck`` (llmexport/models/tower_check.py).

Each prompt's greedy continuation is taken on HF carrying the stored weights (``oracle_runs``,
recomputing the whole sequence each step), the fp32 HF is teacher-forced on it
(``fp32_forced_logits``), then the runtime is teacher-forced on the same ids and generates its own
greedy tokens (``check_media_prompts``), on MNN's exact kernels whatever profile the export ships.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from llmexport.mnn.config import EXACT_KERNELS
from llmexport.mnn.runtime import run_media_prompt
from llmexport.models.tower_check import PromptLogits, TowerCheck

GREEDY_STEPS = 16


def reference_greedy(logits_fn: PromptLogits, prompt: list[int], steps: int,
                     stop_ids: set[int] | frozenset[int]) -> tuple[list[int], np.ndarray]:
    """Greedy continuation recomputing the whole sequence each step, and the last-position logits
    of each step (the teacher-forced logits of ``prompt + greedy[:-1]``); stops after a token in
    ``stop_ids`` (media-token ids: the runtime embeds them as text, HF as padding)."""
    ids, logits = list(prompt), []
    for _ in range(steps):
        logits.append(logits_fn(ids)[-1].numpy())
        ids.append(int(logits[-1].argmax()))
        if ids[-1] in stop_ids:
            break
    return ids[len(prompt):], np.stack(logits)


def oracle_runs(model: nn.Module, check: TowerCheck) -> list[tuple[list[int], np.ndarray]]:
    """(greedy ids, their teacher-forced logits) of each prompt on ``model`` (HF carrying the stored weights)."""
    return [reference_greedy(check.prompt_logits(model, p), p.ids, GREEDY_STEPS, check.stop_ids)
            for p in check.prompts]


def fp32_forced_logits(model: nn.Module, check: TowerCheck,
                       runs: list[tuple[list[int], np.ndarray]]) -> list[np.ndarray]:
    """Teacher-forced logits of ``model`` (the fp32 HF) on each prompt's oracle greedy ids."""
    return [check.prompt_logits(model, p)(p.ids + greedy[:-1])[len(p.ids) - 1:].numpy()
            for p, (greedy, _) in zip(check.prompts, runs)]


def check_media_prompts(export_dir: Path, check: TowerCheck, runs: list[tuple[list[int], np.ndarray]],
                        logits32: list[np.ndarray]) -> list[dict[str, Any]]:
    """Each prompt through MNN's runtime (its medium saved into a temporary folder) against the
    oracle's ``runs`` and the fp32 ``logits32``: one ``compare_prompt`` report per prompt."""
    reports = []
    with tempfile.TemporaryDirectory(prefix="llmexport-media-") as tmp:
        for i, (prompt, (greedy, logits), forced32) in enumerate(zip(check.prompts, runs, logits32)):
            folder = Path(tmp) / str(i)
            folder.mkdir()
            # the tower and its merging are judged on the exact kernels, whatever profile ships
            run = run_media_prompt(export_dir, prompt.runtime_text(folder), greedy[:-1], len(greedy),
                                   config=EXACT_KERNELS)
            report = compare_prompt(run, prompt.ids, greedy, logits, forced32)
            report["label"] = prompt.label
            report["stopped_at_media_token"] = len(greedy) < GREEDY_STEPS
            report["bos_count"] = run.ids.count(check.bos_id)
            if report["bos_count"] != 1:
                report["failures"].append(f"{report['bos_count']} BOS tokens in the runtime's prompt")
            report.update(prompt.info)
            reports.append(report)
    return reports


def compare_prompt(run, prompt_ids: list[int], greedy_ref: list[int], ref_logits: np.ndarray,
                   fp32_logits: np.ndarray | None = None) -> dict[str, Any]:
    """Runtime media-prompt run vs HF: token ids, greedy tokens, teacher-forced logits.

    Failures follow the text verification's rule: a teacher-forced top-1 disagreement counts
    unless the oracle's own top-2 margin is below the error measured at that step (a near-tie).
    """
    from llmexport.verification import step_stats, summarize

    report: dict[str, Any] = {"prompt_tokens": len(prompt_ids), "ids_match": run.ids == prompt_ids,
                              "greedy_ref": greedy_ref, "greedy_mnn": run.greedy_ids,
                              "greedy_match": greedy_ref == run.greedy_ids}
    failures = []
    if not report["ids_match"]:
        failures.append(f"runtime prompt ids differ from HF's ({len(run.ids)} vs {len(prompt_ids)} tokens)")
    if report["ids_match"]:
        forced = summarize(step_stats(run.forced_logits, ref_logits))
        report["forced"] = forced
        for i, s in enumerate(forced["per_step"]):
            if not s["top1_match"] and s["ref_top2_margin"] >= s["max_abs_err"]:
                failures.append(f"step {i}: top-1 {s['mnn_top1']} != {s['ref_top1']} "
                                f"(margin {s['ref_top2_margin']:.4f})")
        if fp32_logits is not None:
            report["fp32"] = {k: v for k, v in summarize(step_stats(run.forced_logits, fp32_logits)).items()
                              if k != "per_step"}
    if not report["greedy_match"]:
        failures.append(f"greedy tokens differ: mnn {run.greedy_ids} vs hf {greedy_ref}")
    report["failures"] = failures
    return report


def prompt_summary(name: str, report: dict[str, Any]) -> str:
    """One phrase per tower for the verification summary line."""
    prompts = report.get("prompts", [])
    state = "ok" if report.get("passed") else "FAILED"
    if not prompts:
        return f"{name} {state}"
    if not all(p["ids_match"] for p in prompts):
        return f"{name} {state} (prompt vs HF: token ids DIFFER)"
    top1 = min(p["forced"]["top1_agreement"] for p in prompts)
    err = max(p["forced"]["max_abs_err"] for p in prompts)
    greedy = "greedy match" if all(p["greedy_match"] for p in prompts) else "greedy DIFFERS"
    return f"{name} {state} (prompt vs HF: top-1 {top1:.0%}, {greedy}, max |dlogit| {err:.2e})"
