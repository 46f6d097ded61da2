"""Half-Quadratic Quantization (HQQ): zero points fitted to the weights, no calibration data.

Badri & Shaji, "Half-Quadratic Quantization of Large Machine Learning Models" (2023). The zero
points come from the ``hqq`` package's proximal solver (``hqq.core.optimize``, pinned in
pyproject.toml): for a block ``W`` with a fixed scale it minimises
``||W - dequant(quant(W))||_p^p`` with ``p < 1``, which tolerates a few large errors (outliers)
instead of spreading them over the whole block. This module only adapts its input and output to
what MNN stores and decodes.

Conventions. HQQ quantizes as ``Wq = round(W * s_inv + z_h)`` with unsigned ``Wq`` in
``[0, 2^b - 1]`` and decodes ``(Wq - z_h) / s_inv``. Ours (see ``llmexport.quant.rtn``) decodes
``q * scale + zero`` with signed ``q = Wq - 2^(b-1)``, so ``s_inv = 1 / scale`` and
``z_h = 2^(b-1) - zero / scale``; back, ``zero = (2^(b-1) - z_h) * scale``, the value of level 0.
RTN's ``zero = min + 2^(b-1) * scale`` is HQQ's own starting point ``z_h = -min * s_inv``. Each
block is one row of the ``[blocks, block]`` matrix handed to the package, with ``axis=1``.

What the wrapper adds, so that the record decodes to exactly what is returned and no block is
worse than RTN:
  * The scale is RTN's, already rounded to ``scale_dtype``; the package optimises the zero only
    (its default: no scale search).
  * The package's zero is rounded to ``scale_dtype`` (what MNN stores), the levels are re-chosen
    against the rounded scale and zero, and a block keeps RTN's result unless the rounded HQQ one
    has a lower mean absolute error (the package's own criterion).
  * Blocks with a zero scale (constant values, exact under RTN already) are not handed over.

Which of the package's entry points, and why: ``optimize_weights_proximal_v2`` with
``dtype=float32`` and ``early_stop=False``, its default parameters otherwise (``lp_norm`` 0.7,
``beta`` 10, ``kappa`` 1.01, 20 iterations, no scale grid search). Its ``optimize_weights_proximal``
(an alias of ``optimize_weights_proximal_legacy``) takes neither argument, and
  * computes in fp16 on CUDA, where ``s_inv = 1/scale`` overflows for scales below 2^-16 and an
    8-bit zero is resolved to 1/8 of a level; in fp32 the arithmetic is the same on either device;
  * stops when the mean error of *everything in the call* stops falling, so a block's zero would
    depend on which other rows share the call (the writers cut every tensor into row slices).
    Without the early stop each block's iterations depend on that block alone, and the result on
    how rows are chunked not at all.
On the LLM-like matrices of ``bench/quant.py --quick`` the two give identical zeros on 17 of 20 (4
and 8 bits) and mean errors equal to 4 digits there; this one's is never the higher
(docs/benchmarks.md, "HQQ").

Symmetric quantization has no zero point to optimise, so ``sym=True`` is plain RTN.
"""

from __future__ import annotations

import torch
from hqq.core.optimize import optimize_weights_proximal_v2

from llmexport.quant.rtn import _check_alpha, _check_args, _to_storage, quantize_rtn
from llmexport.spec import QuantizedTensor

# Defaults of hqq 0.2.8.post1 (hqq/core/optimize.py, optimize_weights_proximal*).
HQQ_LP_NORM = 0.7
HQQ_BETA = 1e1
HQQ_KAPPA = 1.01
HQQ_ITERS = 20

# Weight values worked on at a time (rows of the weight): a few fp32 temporaries of each.
_CHUNK_ELEMENTS = 1 << 22
# Weight values handed to the package per call on the CPU (whole blocks): its ~10 fp32 temporaries
# per value then stay in cache over its 20 iterations, which made it 2x faster than 4M-value calls
# (7.6 -> 14-16 MB/s of fp16 weights on one thread). On a GPU it takes a whole chunk of rows at once.
_SOLVER_ELEMENTS_CPU = 1 << 16


def _levels(wb: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """``clamp(round((W - zero) / scale))`` in fp32, the arithmetic of ``quantize_rtn``."""
    return torch.sub(wb, zero.unsqueeze(-1)).div_(scale.unsqueeze(-1)).round_().clamp_(qmin, qmax)


def _block_mae(wb: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Per-block mean ``|W - (q*scale + zero)|``, with the decoder's fp32 arithmetic."""
    return torch.sub(wb, q.mul(scale.unsqueeze(-1)).add_(zero.unsqueeze(-1))).abs_().mean(-1)


def _package_zero(
    wb: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, opt_params: dict
) -> torch.Tensor:
    """The ``hqq`` package's zero of each block (row of ``wb``), from RTN's ``scale`` and ``zero``,
    in our convention and fp32. ``scale`` must be positive. Blocks are independent (no early
    stop), so how they are split over calls changes nothing."""
    half = 1 << (bits - 1)
    s_inv = scale.reciprocal()
    z_h = torch.sub(half, zero * s_inv)
    step = wb.shape[0] if wb.device.type != "cpu" else max(1, _SOLVER_ELEMENTS_CPU // wb.shape[1])
    out = []
    for i in range(0, wb.shape[0], step):
        _, _, z_opt = optimize_weights_proximal_v2(
            wb[i: i + step], s_inv[i: i + step, None], z_h[i: i + step, None], [0, (1 << bits) - 1],
            axis=1, dtype=torch.float32, opt_params=opt_params,
        )
        out.append(z_opt.reshape(-1).to(torch.float32))
    return torch.sub(half, torch.cat(out)).mul(scale)


def _hqq_rows(w: torch.Tensor, bits: int, block: int, scale_dtype: torch.dtype, opt_params: dict) -> QuantizedTensor:
    """HQQ zero points for a few rows: RTN, the package's zeros, then the per-block choice."""
    rtn = quantize_rtn(w, bits, block, False, scale_dtype)
    assert rtn.zero is not None  # asymmetric RTN
    live = torch.nonzero(rtn.scale.reshape(-1) > 0).squeeze(-1)
    if live.numel() == 0:
        return rtn
    oc, nblocks, _ = rtn.q.shape
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    rtn_q, rtn_zero = rtn.q.reshape(-1, block), rtn.zero.reshape(-1)
    wb = w.detach().to(torch.float32).reshape(-1, block).index_select(0, live)
    scale, zero = rtn.scale.reshape(-1).index_select(0, live), rtn_zero.index_select(0, live)
    q_rtn = rtn_q.index_select(0, live)

    # Store the zero as the runtime will see it, re-pick the levels against it, and keep RTN for
    # any block where that is not better (a non-finite zero compares False and keeps RTN too).
    zero16 = _to_storage(_package_zero(wb, scale, zero, bits, opt_params), scale_dtype)
    q16 = _levels(wb, scale, zero16, qmin, qmax)
    take = _block_mae(wb, q16, scale, zero16) < _block_mae(wb, q_rtn.to(torch.float32), scale, zero)
    out_zero = rtn_zero.index_copy(0, live, torch.where(take, zero16, zero))
    out_q = rtn_q.index_copy(0, live, torch.where(take.unsqueeze(-1), q16.to(torch.int8), q_rtn))
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
    chunk_elements: int = _CHUNK_ELEMENTS,
) -> QuantizedTensor:
    """Quantize ``w [oc, ic]`` block-wise with zero points from the ``hqq`` package, on ``w``'s device.

    The scale of each block is RTN's (min/max, rounded to ``scale_dtype``); only the zero point
    is optimised, as the package does by default. The returned scale and zero are exactly
    representable in ``scale_dtype`` and ``q`` is chosen against those stored values, so
    ``dequantize`` of the result is exactly what MNN decodes; no block's mean absolute error is
    above RTN's. Work is done in fp32, ``chunk_elements // ic`` rows at a time; each block's result
    depends on that block alone, so not on the chunking.

    ``iters=0`` is RTN (the package needs at least 2). ``sym=True`` falls back to symmetric RTN:
    a symmetric grid has no zero point, which is the only thing HQQ optimises here.
    """
    _check_args(w, bits, block)
    if not 0.1 <= lp_norm <= 1.0:  # the package raises any p below 0.1 to 0.1
        raise ValueError(f"lp_norm must lie in [0.1, 1], got {lp_norm}")
    if beta <= 0.0 or kappa <= 1.0 or iters < 0 or iters == 1:
        raise ValueError(f"need beta > 0, kappa > 1 and iters 0 or >= 2; got {beta}, {kappa}, {iters}")
    oc, ic = w.shape
    if sym or oc == 0 or iters == 0:
        return quantize_rtn(w, bits, block, sym, scale_dtype)
    opt_params = {"lp_norm": lp_norm, "beta": beta, "kappa": kappa, "iters": iters, "tol": 0.0,
                  "early_stop": False, "scale_gridsearch": False}
    step = max(1, chunk_elements // ic)
    parts = [_hqq_rows(w[r: r + step], bits, block, scale_dtype, opt_params) for r in range(0, oc, step)]
    if len(parts) == 1:
        return parts[0]
    return QuantizedTensor(
        q=torch.cat([p.q for p in parts]), scale=torch.cat([p.scale for p in parts]),
        zero=torch.cat([p.zero for p in parts if p.zero is not None]), bits=bits, block=block,
    )
