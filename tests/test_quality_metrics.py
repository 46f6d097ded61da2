"""llmexport/verification/quality.py: llama.cpp's perplexity, KLD and top-1 definitions, checked as properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from llmexport.verification.quality import compare, kld, log_softmax, perplexity, token_nll, top1_agreement, windows

_FINITE = st.floats(-30, 30, allow_nan=False, width=32)


@st.composite
def logit_pairs(draw):
    positions, vocab = draw(st.integers(1, 6)), draw(st.integers(2, 12))
    ref = draw(arrays(np.float32, (positions, vocab), elements=_FINITE))
    test = draw(arrays(np.float32, (positions, vocab), elements=_FINITE))
    targets = draw(arrays(np.int64, (positions,), elements=st.integers(0, vocab - 1)))
    return ref, test, targets


def _kld_reference(ref: np.ndarray, test: np.ndarray) -> np.ndarray:
    """Independent float64 reference: explicit sums with Python's math."""
    out = []
    for r, t in zip(ref.astype(float).tolist(), test.astype(float).tolist()):
        zr = math.log(sum(math.exp(x - max(r)) for x in r)) + max(r)
        zt = math.log(sum(math.exp(x - max(t)) for x in t)) + max(t)
        out.append(sum(math.exp(a - zr) * ((a - zr) - (b - zt)) for a, b in zip(r, t)))
    return np.array(out)


@settings(max_examples=60, deadline=None)
@given(logit_pairs())
def test_kld_properties(pair):
    ref, test, _ = pair
    per_position = kld(ref, test)
    assert per_position.shape == (ref.shape[0],)
    assert (per_position >= 0).all()
    np.testing.assert_allclose(kld(ref, ref), 0.0, atol=1e-12)
    np.testing.assert_allclose(per_position, np.maximum(_kld_reference(ref, test), 0), rtol=1e-9, atol=1e-9)
    # a constant added to a row's logits is the same distribution (added in float64: exact)
    np.testing.assert_allclose(kld(ref.astype(np.float64) + 3.5, test.astype(np.float64) - 2.0), per_position,
                               atol=1e-9)


@settings(max_examples=60, deadline=None)
@given(logit_pairs())
def test_nll_and_perplexity_match_torch(pair):
    ref, _, targets = pair
    expected = torch.nn.functional.cross_entropy(torch.tensor(ref, dtype=torch.float64), torch.tensor(targets),
                                                 reduction="none").numpy()
    np.testing.assert_allclose(token_nll(ref, targets), expected, rtol=1e-10, atol=1e-10)
    assert perplexity(token_nll(ref, targets)) == pytest.approx(math.exp(expected.mean()), rel=1e-10)
    np.testing.assert_allclose(np.exp(log_softmax(ref)).sum(-1), 1.0, rtol=1e-12)


@settings(max_examples=60, deadline=None)
@given(logit_pairs())
def test_compare_identical_and_symmetric_parts(pair):
    ref, test, targets = pair
    same = compare(ref, ref, targets)
    assert same.delta_ppl == 0 and same.kld_mean == pytest.approx(0, abs=1e-12) and same.top1 == 1.0
    stats = compare(ref, test, targets)
    assert stats.kld_p99 >= 0 and 0 <= stats.top1 <= 1 and stats.positions == ref.shape[0]
    assert stats.kld_p99 <= kld(ref, test).max() + 1e-12
    assert top1_agreement(ref, test) == top1_agreement(test, ref)


def test_uniform_logits_have_the_vocabulary_as_perplexity():
    logits = np.zeros((5, 37), dtype=np.float32)
    assert perplexity(token_nll(logits, np.arange(5))) == pytest.approx(37.0)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="do not match"):
        token_nll(np.zeros((3, 4)), np.zeros(2, dtype=np.int64))
    with pytest.raises(ValueError, match="differ in shape"):
        kld(np.zeros((3, 4)), np.zeros((3, 5)))
    with pytest.raises(ValueError, match="no scored positions"):
        perplexity(np.zeros(0))
    with pytest.raises(ValueError, match="no token to score"):
        windows([1, 2, 3], 1, 4, bos=0)


@given(st.lists(st.integers(3, 99), max_size=60), st.integers(2, 9), st.integers(1, 5), st.booleans())
def test_windows_are_consecutive_and_start_with_bos(ids, length, count, with_bos):
    bos = 1 if with_bos else None
    out = windows(ids, length, count, bos)
    assert len(out) <= count and all(len(w) == length for w in out)
    body = [t for w in out for t in (w[1:] if with_bos else w)]
    assert body == ids[:len(body)]
    assert all(w[0] == 1 for w in out) if with_bos else True
