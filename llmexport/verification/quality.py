"""Quality of a model's next-token predictions, as llama.cpp's ``perplexity`` tool defines it.

- perplexity: ``exp(mean NLL)`` of the actual next token over the scored positions;
- KLD: per position ``KL(P_ref || P_test) = sum_v P_ref(v) (log P_ref(v) - log P_test(v))``,
  reported as its mean and its 99th percentile;
- top-1 agreement: the share of positions where both put their maximum on the same token;
- delta PPL: ``PPL(test) - PPL(ref)``.

All in float64 from logits (``[positions, vocab]``) whatever their dtype. Scored windows start
with the model's BOS: position ``i``'s logits predict token ``i + 1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-probabilities in float64."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood of each position's target token ``[positions]``."""
    logp = log_softmax(logits)
    targets = np.asarray(targets, dtype=np.int64)
    if logp.shape[:-1] != targets.shape:
        raise ValueError(f"logits {logp.shape} do not match targets {targets.shape}")
    return -np.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def perplexity(nll: np.ndarray) -> float:
    """``exp`` of the mean NLL over the scored positions."""
    nll = np.asarray(nll, dtype=np.float64)
    if nll.size == 0:
        raise ValueError("no scored positions")
    return float(math.exp(nll.mean()))


def kld(ref_logits: np.ndarray, test_logits: np.ndarray) -> np.ndarray:
    """``KL(P_ref || P_test)`` per position (nats), clipped at 0 against rounding."""
    ref, test = log_softmax(ref_logits), log_softmax(test_logits)
    if ref.shape != test.shape:
        raise ValueError(f"reference logits {ref.shape} and test logits {test.shape} differ in shape")
    return np.maximum((np.exp(ref) * (ref - test)).sum(axis=-1), 0.0)


def top1_agreement(ref_logits: np.ndarray, test_logits: np.ndarray) -> float:
    """Share of positions whose argmax is the same token."""
    ref, test = np.asarray(ref_logits), np.asarray(test_logits)
    return float((ref.argmax(axis=-1) == test.argmax(axis=-1)).mean())


@dataclass(frozen=True)
class QualityStats:
    """One test model against a reference on the same scored positions."""

    positions: int
    ppl_ref: float
    ppl_test: float
    kld_mean: float
    kld_p99: float
    top1: float

    @property
    def delta_ppl(self) -> float:
        return self.ppl_test - self.ppl_ref

    def to_json(self) -> dict[str, float]:
        return {"positions": self.positions, "ppl_ref": self.ppl_ref, "ppl_test": self.ppl_test,
                "delta_ppl": self.delta_ppl, "kld_mean": self.kld_mean, "kld_p99": self.kld_p99, "top1": self.top1}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> QualityStats:
        return cls(int(data["positions"]), data["ppl_ref"], data["ppl_test"], data["kld_mean"], data["kld_p99"],
                   data["top1"])

    def summary(self) -> str:
        return (f"PPL {self.ppl_ref:.3f} -> {self.ppl_test:.3f} ({self.delta_ppl:+.3f}), KLD {self.kld_mean:.2e} "
                f"(p99 {self.kld_p99:.2e}), top-1 {self.top1:.1%} over {self.positions} positions")


def compare(ref_logits: np.ndarray, test_logits: np.ndarray, targets: np.ndarray) -> QualityStats:
    """All statistics of ``test_logits`` against ``ref_logits`` on positions predicting ``targets``."""
    return compare_parts([(ref_logits, test_logits, targets)])


def compare_parts(parts: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> QualityStats:
    """``compare`` over parts (windows) taken one at a time: only per-position numbers are kept,
    so the logits of one part are in memory at once."""
    klds, nll_ref, nll_test, same = [], [], [], []
    for ref_logits, test_logits, targets in parts:
        klds.append(kld(ref_logits, test_logits))
        nll_ref.append(token_nll(ref_logits, targets))
        nll_test.append(token_nll(test_logits, targets))
        same.append(np.asarray(ref_logits).argmax(axis=-1) == np.asarray(test_logits).argmax(axis=-1))
    per_position = np.concatenate(klds)
    return QualityStats(int(per_position.size), perplexity(np.concatenate(nll_ref)),
                        perplexity(np.concatenate(nll_test)), float(per_position.mean()),
                        float(np.percentile(per_position, 99)), float(np.concatenate(same).mean()))


def windows(ids: list[int], length: int, count: int, bos: int | None) -> list[list[int]]:
    """Up to ``count`` consecutive, non-overlapping windows of ``ids``, each ``length`` tokens
    long with ``bos`` (when not None) as its first; every token after the first is scored."""
    body = length - (bos is not None)
    if body < 1:
        raise ValueError(f"window length {length} leaves no token to score")
    prefix = [bos] if bos is not None else []
    return [prefix + ids[i:i + body] for i in range(0, len(ids) - body + 1, body)][:count]
