"""Half-Quadratic Quantization (HQQ): zero points fitted to the weights, no calibration data.

Badri & Shaji, "Half-Quadratic Quantization of Large Machine Learning Models" (2023); the
reference is the ``hqq`` package's ``optimize_weights_proximal`` (hqq/core/optimize.py). For a
block ``W`` with a fixed scale ``s`` the zero point is fitted by a proximal (half-quadratic)
solver of ``min_z ||W - dequant(quant(W; s, z))||_p^p`` with ``p < 1``, which tolerates a few
large errors (outliers) instead of spreading them over the whole block. Each iteration:

  (a) ``q = clamp(round((W - z) / s))`` and ``R = q*s + z`` (the reconstruction);
  (b) ``E = shrink_p(W - R, beta)``: the generalised soft threshold of the l_p norm,
      ``sign(x) * max(|x| - |x|^(p-1) / beta, 0)`` — the part of the error treated as sparse;
  (c) ``z = mean over the block of (W - E - q*s)``: the closed-form zero given ``q`` and ``E``;
  then ``beta *= kappa``.

Conventions. HQQ quantizes as ``Wq = round(W * s_inv + z_h)`` with unsigned ``Wq`` in
``[0, 2^b - 1]`` and decodes ``(Wq - z_h) / s_inv``. Ours (see ``llmexport.quant.rtn``) decodes
``q * scale + zero`` with signed ``q = Wq - 2^(b-1)``, so ``scale = 1 / s_inv`` and
``zero = (2^(b-1) - z_h) * scale``, i.e. the value of level 0. HQQ's zero update
``z_h = mean(Wq - (W - E) * s_inv)`` becomes, in our convention, ``zero = mean(W - E - q*scale)``,
which is what step (c) computes; its initial ``z_h = -min * s_inv`` is RTN's
``zero = min + 2^(b-1) * scale``.

Where this differs from the package, and why:
  * The scale is RTN's, already rounded to ``scale_dtype``. The zero iterates in fp32 (as in
    the package; rounding every iterate to fp16 would freeze any zero whose step is below half
    an fp16 ulp, which costs most of the gain at 8 bits). The best zero is then rounded to
    ``scale_dtype``, the levels are re-chosen against the rounded values, and a block keeps
    RTN's result if the rounded HQQ one is not better: no block's mean absolute error (the
    package's criterion) is ever worse than RTN's, and what is returned is exactly what MNN
    decodes.
  * The best iterate and the early stop are per block rather than per tensor: a block stops
    at its first iteration that does not lower its mean absolute error (the package's rule,
    which it applies to the tensor's mean) and keeps its best zero. Results therefore do not
    depend on how rows are chunked. It does ~3.5 iterations per block on LLM-like weights;
    ``early_stop=False`` runs all ``iters`` (about 2x slower, ~0.5% lower error, on par with
    the package).
  * ``beta`` grows by ``kappa`` every iteration (as in ``optimize_weights_proximal_v2``; the
    package's default ``_legacy`` solver takes ``kappa`` but never applies it).

Symmetric quantization has no zero point to optimise, so ``sym=True`` is plain RTN.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from llmexport.quant.rtn import _check_alpha, _check_args, _to_storage, quantize_rtn
from llmexport.spec import QuantizedTensor

if TYPE_CHECKING:  # the writer owns the Quantizer signature; importing it at runtime is not needed
    pass

# Defaults of hqq 0.2.8.post1 (hqq/core/optimize.py, optimize_weights_proximal_legacy).
HQQ_LP_NORM = 0.7
HQQ_BETA = 1e1
HQQ_KAPPA = 1.01
HQQ_ITERS = 20

_CHUNK_ELEMENTS = 1 << 22  # weight values optimised at a time (a few fp32 temporaries each)


def _sparse_mean(
    diff: torch.Tensor, mag: torch.Tensor, beta: float, lp_norm: float
) -> Optional[torch.Tensor]:
    """Per-block mean of the generalised soft threshold of ``diff``, or None if it is all 0.

    ``shrink_p(x) = sign(x) * max(|x| - |x|^(p-1) / beta, 0)`` is non-zero only where
    ``|x|^(2-p) > 1/beta``; on typical LLM weights (errors far below that) nothing survives, so
    the power is evaluated only on the entries above the threshold, if any. ``mag = |diff|``.
    """
    thresh = (1.0 / beta) ** (1.0 / (2.0 - lp_norm))
    if diff.numel() == 0 or float(mag.max()) <= thresh:
        return None
    keep = mag > thresh
    m = mag[keep]
    shrunk = (m - m.pow(lp_norm - 1.0) / beta).clamp_min_(0.0).mul_(torch.sign(diff[keep]))
    out = torch.zeros_like(diff)
    out[keep] = shrunk
    return out.mean(-1)


def _levels(wb: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """``clamp(round((W - zero) / scale))`` in fp32, the arithmetic of ``quantize_rtn``."""
    return torch.sub(wb, zero.unsqueeze(-1)).div_(scale.unsqueeze(-1)).round_().clamp_(qmin, qmax)


def _block_mae(wb: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Per-block mean ``|W - (q*scale + zero)|``, with the decoder's fp32 arithmetic."""
    return torch.sub(wb, q.mul(scale.unsqueeze(-1)).add_(zero.unsqueeze(-1))).abs_().mean(-1)


class _WorkingSet:
    """Blocks still iterating, with their current and best zeros; compacted when it thins out."""

    def __init__(
        self, wb: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, active: torch.Tensor
    ) -> None:
        self.pos = torch.arange(wb.shape[0], device=wb.device)  # rows of the full block arrays
        self.wb, self.scale, self.zero, self.active = wb, scale, zero.clone(), active
        self.best_zero = zero.clone()
        self.best_err = torch.full_like(zero, float("inf"))

    def compact(self, out_zero: torch.Tensor, *extra: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Write finished blocks' best zeros to ``out_zero``; keep only the active blocks here
        and in ``extra`` (per-block tensors of the same rows), which are returned."""
        out_zero[self.pos] = self.best_zero
        keep = torch.nonzero(self.active).squeeze(-1)
        for name in ("pos", "wb", "scale", "zero", "active", "best_zero", "best_err"):
            setattr(self, name, getattr(self, name).index_select(0, keep))
        return tuple(t.index_select(0, keep) for t in extra)


def _hqq_rows(
    w: torch.Tensor, bits: int, block: int, scale_dtype: torch.dtype,
    iters: int, lp_norm: float, beta: float, kappa: float, early_stop: bool,
) -> QuantizedTensor:
    """HQQ zero-point optimisation of a few rows, all their blocks at once."""
    rtn = quantize_rtn(w, bits, block, False, scale_dtype)
    if iters == 0:
        return rtn
    oc, nblocks, _ = rtn.q.shape
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    wb_all = w.detach().to(torch.float32).reshape(-1, block)
    assert rtn.zero is not None  # asymmetric RTN
    rtn_zero = rtn.zero.reshape(-1)
    rtn_q = rtn.q.reshape(-1, block)
    # A zero scale means a constant block, which RTN already decodes exactly: it never iterates
    # (and divides by 1 instead of 0).
    live = rtn.scale.reshape(-1) > 0
    safe = torch.where(live, rtn.scale.reshape(-1), torch.ones_like(rtn_zero))
    rtn_err = _block_mae(wb_all, rtn_q.to(torch.float32), safe, rtn_zero)

    # The zeros iterate in fp32, as in the package: rounding every iterate to fp16 would
    # freeze a zero whose step is below half an fp16 ulp (which matters at 8 bits).
    ws = _WorkingSet(wb_all, safe, rtn_zero, live)
    ws.best_err = torch.where(live, rtn_err, ws.best_err)
    best_zero = rtn_zero.clone()  # full-size; the working set writes back into it
    diff = torch.sub(wb_all, rtn_q.to(torch.float32).mul_(safe.unsqueeze(-1)).add_(rtn_zero.unsqueeze(-1)))
    mag = diff.abs()
    for _ in range(iters):
        # (b) sparse error E and (c) the closed-form zero mean(W - E - q*s), written as a step
        # from the current zero: mean(W - q*s) = zero + mean(diff). Then (a) the new levels.
        sparse = _sparse_mean(diff, mag, beta, lp_norm)
        step = diff.mean(-1) if sparse is None else diff.mean(-1).sub_(sparse)
        ws.zero = torch.where(ws.active, ws.zero + step, ws.zero)
        beta *= kappa
        shifted = torch.sub(ws.wb, ws.zero.unsqueeze(-1))
        q = torch.div(shifted, ws.scale.unsqueeze(-1)).round_().clamp_(qmin, qmax)
        diff = shifted.addcmul_(q, ws.scale.unsqueeze(-1), value=-1.0)  # W - (q*s + z)
        mag = diff.abs()
        err = mag.mean(-1)

        better = ws.active & (err < ws.best_err)
        ws.best_err = torch.where(better, err, ws.best_err)
        ws.best_zero = torch.where(better, ws.zero, ws.best_zero)
        if early_stop:
            # The package stops once the tensor's error stops going down; here each block does.
            ws.active = better
        n_active = int(ws.active.sum())
        if n_active == 0:
            break
        if 2 * n_active < ws.pos.numel():  # drop finished blocks once they are the majority
            diff, mag = ws.compact(best_zero, diff, mag)
    best_zero[ws.pos] = ws.best_zero

    # Store the best zero as the runtime will see it, re-pick the levels against it, and keep
    # RTN for any block where the stored result is not better.
    zero16 = _to_storage(best_zero, scale_dtype)
    q16 = _levels(wb_all, safe, zero16, qmin, qmax)
    take = live & (_block_mae(wb_all, q16, safe, zero16) < rtn_err)
    out_zero = torch.where(take, zero16, rtn_zero)
    out_q = torch.where(take.unsqueeze(-1), q16.to(torch.int8), rtn_q)
    _check_alpha(out_zero)
    return QuantizedTensor(
        q=out_q.reshape(oc, nblocks, block), scale=rtn.scale, zero=out_zero.reshape(oc, nblocks),
        bits=bits, block=block,
    )


def quantize_hqq(
    w: torch.Tensor,
    bits: int,
    block: int,
    sym: bool = False,
    scale_dtype: torch.dtype = torch.float16,
    iters: int = HQQ_ITERS,
    lp_norm: float = HQQ_LP_NORM,
    beta: float = HQQ_BETA,
    kappa: float = HQQ_KAPPA,
    early_stop: bool = True,
    chunk_elements: int = _CHUNK_ELEMENTS,
) -> QuantizedTensor:
    """Quantize ``w [oc, ic]`` block-wise with HQQ-optimised zero points, on ``w``'s device.

    The scale of each block is RTN's (min/max, rounded to ``scale_dtype``); only the zero point
    is optimised, as the ``hqq`` package does by default. The returned scale and zero are
    exactly representable in ``scale_dtype`` and ``q`` is chosen against those stored values,
    so ``dequantize`` of the result is exactly what MNN decodes. Work is done in fp32, all
    blocks of ``chunk_elements // ic`` rows at a time.

    ``iters=0`` is RTN. ``sym=True`` falls back to symmetric RTN: a symmetric grid has no zero
    point, which is the only thing HQQ optimises here.
    """
    _check_args(w, bits, block)
    if not 0.0 < lp_norm <= 1.0:
        raise ValueError(f"lp_norm must lie in (0, 1], got {lp_norm}")
    if beta <= 0.0 or kappa < 1.0 or iters < 0:
        raise ValueError(f"need beta > 0, kappa >= 1, iters >= 0; got {beta}, {kappa}, {iters}")
    oc, ic = w.shape
    if sym or oc == 0:
        return quantize_rtn(w, bits, block, sym, scale_dtype)
    step = max(1, chunk_elements // ic)
    parts = [
        _hqq_rows(w[r: r + step], bits, block, scale_dtype, iters, lp_norm, beta, kappa, early_stop)
        for r in range(0, oc, step)
    ]
    if len(parts) == 1:
        return parts[0]
    return QuantizedTensor(
        q=torch.cat([p.q for p in parts]), scale=torch.cat([p.scale for p in parts]),
        zero=torch.cat([p.zero for p in parts if p.zero is not None]), bits=bits, block=block,
    )
