"""Teacher-forced logits of a runtime run against a reference's, and the one rule that judges them.

Every check compares logits this way: the single prompt and its exact-kernels run
(llmexport/verification.py), each conversation turn (llmexport/verification_conversation.py) and
each media prompt (llmexport/verification_media.py). A step's top-1 disagreement counts unless the
reference's own top-2 margin is below the error measured at that step (a near-tie:
``StepStats.flipped``).
"""

from __future__ import annotations

import numpy as np

from llmexport.results import LogitStats, StepStats


def compare_logits(mnn: np.ndarray, ref: np.ndarray) -> LogitStats:
    """Teacher-forced logits of a runtime run ``[steps, vocab]`` against the reference's."""
    steps = []
    for m, r in zip(mnn, ref):
        top2 = np.sort(r)[-2:]
        err = np.abs(m - r)
        steps.append(StepStats(float(err.max()), float(err.mean()), float(top2[1] - top2[0]),
                               int(m.argmax()) == int(r.argmax()), int(m.argmax()), int(r.argmax())))
    return LogitStats(sum(s.top1_match for s in steps) / len(steps), max(s.max_abs_err for s in steps),
                      float(np.mean([s.mean_abs_err for s in steps])), tuple(steps))


def step_failures(label: str, run: LogitStats) -> list[str]:
    """The steps of ``run`` whose top-1 disagreement counts, one failure each."""
    return [f"{label}step {i}: top-1 {s.mnn_top1} != {s.ref_top1} (margin {s.ref_top2_margin:.4f})"
            for i, s in enumerate(run.per_step) if s.flipped]


def run_failures(label: str, run: LogitStats, max_abs: float, mean_abs: float | None) -> list[str]:
    """``step_failures`` and the errors at or over their bounds (``mean_abs`` None: not bounded)."""
    failures = step_failures(label, run)
    if run.max_abs_err >= max_abs:
        failures.append(f"{label}max abs logit error {run.max_abs_err:.5f} >= {max_abs}")
    if mean_abs is not None and run.mean_abs_err >= mean_abs:
        failures.append(f"{label}mean abs logit error {run.mean_abs_err:.5f} >= {mean_abs}")
    return failures
