"""Media prompts: MNN's runtime through its normal call path vs HF's full model called as a user
calls it, for the ``PromptCase``s of a ``TowerCheck`` (llmexport/models/tower_check.py).

The runtime goes first, on MNN's exact kernels whatever profile the export ships: its greedy
continuation of each prompt, with its logits at every step (teacher forcing on its own greedy ids).
HF carrying the stored weights and the fp32 HF are then teacher-forced on the same ids, one forward
each; HF's greedy ids follow its argmax along the runtime's (``greedy_along``), which is its own
greedy continuation wherever the two agree (``check_media_prompts``).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Collection, Sequence

import numpy as np
from torch import nn

from llmexport.mnn.config import EXACT_KERNELS
from llmexport.mnn.runtime import MediaRun, run_media_prompt
from llmexport.models.tower_check import PromptLogits, TowerCheck
from llmexport.results import MediaPromptReport, TowerReport
from llmexport.verification.logits import compare_logits, run_failures, step_failures

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


def greedy_along(logits: np.ndarray, tokens: Sequence[int], stop_ids: Collection[int]) -> list[int]:
    """HF's greedy ids along the runtime's ``tokens``, from its teacher-forced ``logits`` on them:
    each step's argmax while it is the runtime's token, ending with the first other one or a stop
    id. Where every step agrees this is HF's own greedy continuation, in one forward instead of
    one per token."""
    greedy: list[int] = []
    for row, token in zip(logits, tokens):
        greedy.append(int(row.argmax()))
        if greedy[-1] != token or greedy[-1] in stop_ids:
            break
    return greedy


def through_stop(tokens: Sequence[int], stop_ids: Collection[int]) -> list[int]:
    """``tokens`` up to and including the first stop id (a media token: the runtime embeds it as
    text, HF as padding, so nothing after it compares)."""
    out: list[int] = []
    for token in tokens:
        out.append(token)
        if token in stop_ids:
            break
    return out


def check_media_prompts(export_dir: Path, check: TowerCheck, oracle: nn.Module,
                        fp32: nn.Module, max_abs: float | None = None) -> list[MediaPromptReport]:
    """Each prompt through MNN's runtime (its medium saved into a temporary folder), then HF
    (``oracle``: the stored weights; ``fp32``) on the runtime's ids: one ``compare_prompt`` report
    per prompt, with the prompt's label and fields and its runtime prompt's BOS count."""
    reports = []
    with tempfile.TemporaryDirectory(prefix="llmexport-media-") as tmp:
        for i, prompt in enumerate(check.prompts):
            folder = Path(tmp) / str(i)
            folder.mkdir()
            # the tower and its merging are judged on the exact kernels, whatever profile ships
            run = run_media_prompt(export_dir, prompt.runtime_text(folder), None, GREEDY_STEPS, config=EXACT_KERNELS)
            tokens = through_stop(run.greedy_ids, check.stop_ids)
            run = MediaRun(run.ids, run.forced_logits[:len(tokens)], tokens)
            context = prompt.ids + tokens[:-1]
            logits = check.prompt_logits(oracle, prompt)(context, len(prompt.ids) - 1).numpy()
            forced32 = check.prompt_logits(fp32, prompt)(context, len(prompt.ids) - 1).numpy()
            report = compare_prompt(run, prompt.ids, greedy_along(logits, tokens, check.stop_ids), logits, forced32,
                                    max_abs)
            expected = 0 if check.bos_id is None else 1  # a tokenizer without BOS (Qwen) must not get one
            bos_count = 0 if check.bos_id is None else run.ids.count(check.bos_id)
            bos = (f"{bos_count} BOS tokens in the runtime's prompt",) if bos_count != expected else ()
            reports.append(dataclasses.replace(report, failures=report.failures + bos, label=prompt.label,
                                               stopped_at_media_token=len(tokens) < GREEDY_STEPS,
                                               bos_count=bos_count, info=dict(prompt.info)))
    return reports


def compare_prompt(run: MediaRun, prompt_ids: list[int], greedy_ref: list[int], ref_logits: np.ndarray,
                   fp32_logits: np.ndarray | None = None, max_abs: float | None = None) -> MediaPromptReport:
    """Runtime media-prompt run vs HF: token ids, greedy tokens, teacher-forced logits (the
    prompt's label, fields and BOS count are ``check_media_prompts``'s to fill in).

    Failures follow the text verification's rule (llmexport/verification/logits.py): a
    teacher-forced top-1 disagreement counts unless its two logits' movements explain it (a
    near-tie), and the errors stay below ``max_abs`` (the export's exact-kernels bound; None: not
    bounded).
    """
    ids_match = run.ids == prompt_ids
    failures, forced, fp32 = [], None, None
    if not ids_match:
        failures.append(f"runtime prompt ids differ from HF's ({len(run.ids)} vs {len(prompt_ids)} tokens)")
    else:
        forced = compare_logits(run.forced_logits, ref_logits)
        failures += step_failures("", forced) if max_abs is None else run_failures("", forced, max_abs, None)
        if fp32_logits is not None:
            fp32 = compare_logits(run.forced_logits, fp32_logits).summary()
    if greedy_ref != run.greedy_ids:
        failures.append(f"greedy tokens differ: mnn {run.greedy_ids} vs hf {greedy_ref}")
    return MediaPromptReport(len(prompt_ids), ids_match, tuple(greedy_ref), tuple(run.greedy_ids), tuple(failures),
                             forced, fp32)


def prompt_summary(name: str, tower: TowerReport) -> str:
    """One phrase per tower for the verification summary line."""
    prompts = tower.prompts
    state = "ok" if tower.passed else "FAILED"
    if not prompts:
        return f"{name} {state}"
    forced = [p.forced for p in prompts if p.ids_match and p.forced is not None]
    if len(forced) < len(prompts):
        return f"{name} {state} (prompt vs HF: token ids DIFFER)"
    top1 = min(f.top1_agreement for f in forced)
    err = max(f.max_abs_err for f in forced)
    greedy = "greedy match" if all(p.greedy_match for p in prompts) else "greedy DIFFERS"
    return f"{name} {state} (prompt vs HF: top-1 {top1:.0%}, {greedy}, max |dlogit| {err:.2e})"
