"""The media-prompt comparison's own rules (llmexport/verification/media.py), without a model."""

from __future__ import annotations

import json

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmexport.mnn.runtime import MediaRun
from llmexport.results import MediaPromptReport, TowerReport
from llmexport.verification.media import compare_prompt, prompt_summary, reference_greedy

VOCAB = 12


def _scripted(tokens: list[int]):
    """A logits function whose greedy choice after a prefix of length n is tokens[n - start]."""
    start = []

    def logits(ids: list[int]) -> torch.Tensor:
        if not start:
            start.append(len(ids))
        out = torch.zeros(len(ids), VOCAB)
        out[-1, tokens[len(ids) - start[0]]] = 1.0
        return out

    return logits


@settings(max_examples=50, deadline=None)
@given(tokens=st.lists(st.integers(0, VOCAB - 1), min_size=16, max_size=16), stop=st.sets(st.integers(0, VOCAB - 1)))
def test_greedy_stops_after_a_media_token(tokens, stop):
    greedy, logits = reference_greedy(_scripted(tokens), [1, 2, 3], 16, stop)
    first = next((i for i, t in enumerate(tokens) if t in stop), None)
    assert greedy == (tokens if first is None else tokens[:first + 1])
    assert logits.shape == (len(greedy), VOCAB) and list(logits.argmax(-1)) == greedy


def _run(ids, greedy, logits):
    return MediaRun(ids=ids, forced_logits=np.asarray(logits, np.float32), greedy_ids=greedy)


def _tower(passed, *prompts):
    return TowerReport(() if passed else ("failed",), 1e-3, "cases", (), prompts)


def test_comparison_fails_on_ids_greedy_and_top1():
    ref = np.eye(4, dtype=np.float32)[[1, 2]] * 3
    agree = compare_prompt(_run([5, 6], [1, 2], ref + 1e-4), [5, 6], [1, 2], ref, ref)
    assert agree.failures == () and agree.forced.top1_agreement == 1.0 and agree.fp32 == agree.forced.summary()
    assert prompt_summary("visual", _tower(True, agree)).startswith("visual ok (prompt vs HF: top-1 100%, greedy match")
    wrong_top1 = compare_prompt(_run([5, 6], [3, 2], np.eye(4)[[3, 2]] * 3), [5, 6], [1, 2], ref, max_abs=0.2)
    assert "max abs logit error 3.00000 >= 0.2" in wrong_top1.failures  # the flip's movements are over the bound
    assert "greedy tokens differ: mnn [3, 2] vs hf [1, 2]" in wrong_top1.failures and wrong_top1.fp32 is None
    other_ids = compare_prompt(_run([5, 6, 7], [1, 2], ref), [5, 6], [1, 2], ref)
    assert other_ids.failures[0].startswith("runtime prompt ids differ") and other_ids.forced is None
    assert "forced" not in other_ids.to_json()
    assert prompt_summary("audio", _tower(False, other_ids)) == "audio FAILED (prompt vs HF: token ids DIFFER)"
    assert "visual FAILED (prompt vs HF: top-1 50%, greedy DIFFERS, max |dlogit| 3.00e+00)" in prompt_summary(
        "visual", _tower(False, wrong_top1))
    assert prompt_summary("audio", _tower(True)) == "audio ok"
    for report in (agree, wrong_top1, other_ids):
        assert MediaPromptReport.from_json(json.loads(json.dumps(report.to_json()))) == report
