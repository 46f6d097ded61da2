"""Teacher-forced logits of a runtime run against a reference's, and the one rule that judges them.

Every check compares logits this way: the single prompt and its exact-kernels run
(llmexport/verification/verify.py), each conversation turn (llmexport/verification/conversation.py) and
each media prompt (llmexport/verification/media.py).

The near-tie rule (``StepStats.flipped``). When the runtime's top-1 ``b`` is not the reference's ``a``,
both logits moved, in opposite directions: the flip closes the reference's gap ``r[a] - r[b]`` with the
two movements. A flip counts only when that gap is more than what the two logits moved
(``StepStats.noise_explains``: ``|m[a] - r[a]| + |m[b] - r[b]|``, at most twice the step's max error);
the rule it replaces compared the reference's top-2 margin with the max error alone, one logit's worth,
and failed correct exports on AVX-512 machines (torch's kernels there, docs/verification.md). Measured
on the same arrays, a flip is always within its two movements, so it never fails by itself: whether the
movements are noise is what the error bounds judge (``run_failures``), and a defect (a wrong mask, a
swapped layer) moves the logits past them. Only inconsistent numbers (a report edited or built by hand)
can count a flip.
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
        a, b = int(r.argmax()), int(m.argmax())
        # the gap and the two movements in float64: differences of float32 values are exact there, so a
        # flip is never counted by a rounding of its own numbers
        gap = float(r[a]) - float(r[b])
        moved = abs(float(m[a]) - float(r[a])) + abs(float(m[b]) - float(r[b])) if a != b else 0.0
        steps.append(StepStats(float(err.max()), float(err.mean()), float(top2[1] - top2[0]), a == b, b, a,
                               gap, moved))
    return LogitStats(sum(s.top1_match for s in steps) / len(steps), max(s.max_abs_err for s in steps),
                      float(np.mean([s.mean_abs_err for s in steps])), tuple(steps))


def step_failures(label: str, run: LogitStats) -> list[str]:
    """The steps of ``run`` whose top-1 disagreement counts, one failure each."""
    return [f"{label}step {i}: top-1 {s.mnn_top1} != {s.ref_top1} (gap {s.ref_gap:.4f} > the {s.noise_explains:.4f} "
            f"its two logits moved)" for i, s in enumerate(run.per_step) if s.flipped]


def run_failures(label: str, run: LogitStats, max_abs: float, mean_abs: float | None) -> list[str]:
    """``step_failures`` and the errors at or over their bounds (``mean_abs`` None: not bounded)."""
    failures = step_failures(label, run)
    if run.max_abs_err >= max_abs:
        failures.append(f"{label}max abs logit error {run.max_abs_err:.5f} >= {max_abs}")
    if mean_abs is not None and run.mean_abs_err >= mean_abs:
        failures.append(f"{label}mean abs logit error {run.mean_abs_err:.5f} >= {mean_abs}")
    return failures
