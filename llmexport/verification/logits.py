"""Teacher-forced logits of a runtime run against a reference's, and the one rule that judges them.

Every check compares logits this way: the single prompt and its exact-kernels run
(llmexport/verification/verify.py), each conversation turn (llmexport/verification/conversation.py) and
each media prompt (llmexport/verification/media.py).

The near-tie rule (``StepStats.flipped``). When the runtime's top-1 ``b`` is not the reference's
``a``, both logits moved: the flip closes the reference's gap ``r[a] - r[b]`` with the sum of the
two movements. Any flip is therefore explained by *its own* two errors, and by twice the step's
max error; judging it against those would never count one. What makes a flip noise is that its two
movements look like the rest of the step: each is counted up to the largest error measured on the
other logits of the vocabulary, and the flip counts only when the gap is more than that sum. Kernel
noise (fp16 rounding, 8-bit activations) spreads over every logit, so it passes on any CPU's
kernels; a defect that moves just the deciding logits fails. A defect that moves every logit (a
wrong mask, a swapped layer) is judged by the error bounds (``run_failures``), as before.
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
        steps.append(StepStats(float(err.max()), float(err.mean()), float(top2[1] - top2[0]), a == b, b, a,
                               float(r[a] - r[b]), noise_explains(err, a, b)))
    return LogitStats(sum(s.top1_match for s in steps) / len(steps), max(s.max_abs_err for s in steps),
                      float(np.mean([s.mean_abs_err for s in steps])), tuple(steps))


def noise_explains(err: np.ndarray, a: int, b: int) -> float:
    """How much of the reference's gap between logits ``a`` and ``b`` the step's noise closes: their
    two errors, each counted up to the largest error on the rest of the vocabulary (``err``: the
    step's absolute errors). 0 when ``a == b``."""
    if a == b:
        return 0.0
    rest = np.delete(err, [a, b])
    noise = float(rest.max()) if rest.size else 0.0
    return min(float(err[a]), noise) + min(float(err[b]), noise)


def step_failures(label: str, run: LogitStats) -> list[str]:
    """The steps of ``run`` whose top-1 disagreement counts, one failure each."""
    return [f"{label}step {i}: top-1 {s.mnn_top1} != {s.ref_top1} (gap {s.ref_gap:.4f} > the {s.noise_explains:.4f} "
            f"the step's noise explains)" for i, s in enumerate(run.per_step) if s.flipped]


def run_failures(label: str, run: LogitStats, max_abs: float, mean_abs: float | None) -> list[str]:
    """``step_failures`` and the errors at or over their bounds (``mean_abs`` None: not bounded)."""
    failures = step_failures(label, run)
    if run.max_abs_err >= max_abs:
        failures.append(f"{label}max abs logit error {run.max_abs_err:.5f} >= {max_abs}")
    if mean_abs is not None and run.mean_abs_err >= mean_abs:
        failures.append(f"{label}mean abs logit error {run.mean_abs_err:.5f} >= {mean_abs}")
    return failures
