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
  * The scale is RTN's, already rounded to ``scale_dtype``, and every candidate zero is rounded
    to ``scale_dtype`` before its levels are chosen, so the error that decides between
    iterates is the error of exactly what MNN will decode (the package works in fp16 on CUDA
    for the same reason).
  * The best iterate and the early stop are tracked per block rather than over the whole
    tensor: a block stops when its mean absolute error (the package's criterion) no longer
    improves, and keeps its best zero. Iterate 0 is RTN bit for bit, so no block's mean
    absolute error is ever worse than RTN's.
  * ``beta`` grows by ``kappa`` every iteration (as in ``optimize_weights_proximal_v2``; the
    package's default ``_legacy`` solver takes ``kappa`` but never applies it).

Symmetric quantization has no zero point to optimise, so ``sym=True`` is plain RTN.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

import torch

from llmexport.quant.rtn import QuantizedTensor, _check_alpha, _check_args, _to_storage, quantize_rtn
from llmexport.quant.scheme import QuantMethod

if TYPE_CHECKING:  # the writer owns the Quantizer signature; importing it at runtime is not needed
    from llmexport.mnn.weights import Quantizer

# Defaults of hqq 0.2.8.post1 (hqq/core/optimize.py, optimize_weights_proximal_legacy).
HQQ_LP_NORM = 0.7
HQQ_BETA = 1e1
HQQ_KAPPA = 1.01
HQQ_ITERS = 20

_CHUNK_ELEMENTS = 1 << 22  # weight values optimised at a time (each needs ~8 fp32 temporaries)


def _shrink_lp(x: torch.Tensor, beta: float, lp_norm: float) -> torch.Tensor:
    """Generalised soft threshold ``sign(x) * max(|x| - |x|^(p-1) / beta, 0)``.

    It is non-zero only where ``|x|^(2-p) > 1/beta``; on typical LLM weights (errors far below
    that) nothing survives, so the power is evaluated only on the entries above the threshold.
    """
    mag = x.abs()
    if lp_norm == 1.0:
        return torch.sign(x) * (mag - 1.0 / beta).clamp_min_(0.0)
    keep = mag > (1.0 / beta) ** (1.0 / (2.0 - lp_norm))
    out = torch.zeros_like(x)
    if bool(keep.any()):
        m = mag[keep]
        out[keep] = torch.sign(x[keep]) * (m - m.pow(lp_norm - 1.0) / beta).clamp_min_(0.0)
    return out


def _levels(wb: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """``clamp(round((W - zero) / scale))`` as fp32, the same arithmetic as ``quantize_rtn``."""
    return torch.round((wb - zero.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp_(qmin, qmax)


def _hqq_rows(
    w: torch.Tensor, bits: int, block: int, scale_dtype: torch.dtype,
    iters: int, lp_norm: float, beta: float, kappa: float, early_stop: bool,
) -> QuantizedTensor:
    """HQQ zero-point optimisation of a few rows, all their blocks at once."""
    rtn = quantize_rtn(w, bits, block, False, scale_dtype)
    oc, nblocks, _ = rtn.q.shape
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1

    wb_all = w.detach().to(torch.float32).reshape(-1, block)
    scale_all = rtn.scale.reshape(-1)
    best_zero = rtn.zero.reshape(-1).clone()
    best_q = rtn.q.reshape(-1, block).clone()
    q_all = best_q.to(torch.float32)
    best_err = (wb_all - (q_all * scale_all.unsqueeze(-1) + best_zero.unsqueeze(-1))).abs().mean(-1)

    # Working set: blocks with a usable scale (a zero scale means a constant block, which RTN
    # already decodes exactly); it shrinks as blocks stop improving.
    idx = torch.nonzero(scale_all > 0).squeeze(-1)
    wb, s, q = wb_all[idx], scale_all[idx], q_all[idx]
    recon = q * s.unsqueeze(-1) + best_zero[idx].unsqueeze(-1)
    err_prev = best_err[idx]
    for _ in range(iters):
        if idx.numel() == 0:
            break
        # (b) sparse error, (c) closed-form zero, then (a) for the next iterate.
        sparse = _shrink_lp(wb - recon, beta, lp_norm)
        zero = _to_storage((wb - sparse - q * s.unsqueeze(-1)).mean(-1), scale_dtype)
        beta *= kappa
        q = _levels(wb, s, zero, qmin, qmax)
        recon = q * s.unsqueeze(-1) + zero.unsqueeze(-1)
        err = (wb - recon).abs().mean(-1)

        better = err < best_err[idx]
        if bool(better.any()):
            hit = idx[better]
            best_err[hit] = err[better]
            best_zero[hit] = zero[better]
            best_q[hit] = q[better].to(torch.int8)
        if early_stop:
            # The package stops once the error stops going down; here each block does.
            going = err < err_prev
            if not bool(going.all()):
                idx, wb, s, q, recon, err = idx[going], wb[going], s[going], q[going], recon[going], err[going]
        err_prev = err

    _check_alpha(best_zero)
    return QuantizedTensor(
        q=best_q.reshape(oc, nblocks, block), scale=rtn.scale, zero=best_zero.reshape(oc, nblocks),
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
    if sym:
        return quantize_rtn(w, bits, block, True, scale_dtype)
    oc, ic = w.shape
    step = max(1, chunk_elements // ic)
    parts = [
        _hqq_rows(w[r: r + step], bits, block, scale_dtype, iters, lp_norm, beta, kappa, early_stop)
        for r in range(0, oc, step)
    ]
    if len(parts) == 1:
        return parts[0]
    return QuantizedTensor(
        q=torch.cat([p.q for p in parts]), scale=torch.cat([p.scale for p in parts]),
        zero=torch.cat([p.zero for p in parts]), bits=bits, block=block,
    )


def quantizer_for(method: Union[QuantMethod, str]) -> "Quantizer":
    """The quantizer function of a ``QuantScheme.method``: ``quantize_rtn`` or ``quantize_hqq``."""
    method = QuantMethod(method)
    if method is QuantMethod.HQQ:
        return quantize_hqq
    return quantize_rtn
