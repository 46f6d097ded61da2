"""GPTQ: error-compensating rounding of one linear, given the second moment of its inputs.

Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers"
(2022). For a linear ``y = W x`` and calibration inputs ``X``, the loss of a quantized ``Q`` is
``tr((W - Q) H (W - Q)^T)`` with ``H = X^T X``. Columns are rounded one at a time, in input order;
the rounding error of column ``j``, divided by the ``j``-th diagonal element of the inverse
Hessian's upper Cholesky factor ``U``, is pushed onto the columns not yet rounded through row ``j``
of ``U`` (the optimal update of the remaining weights, the optimal brain surgeon step).

What the record holds stays MNN's: blocks of ``block`` inputs share a scale (and zero), chosen by
the base method (RTN's fp16-rounded grid, or HQQ's) from the block's weights *as updated* when the
block's first column is reached, and every level is chosen against those stored values, so
``rtn.dequantize`` of the result is exactly what the runtime decodes. Columns keep their order
(no act-order), so blocks stay contiguous. A linear whose GPTQ loss is not below the base method's
keeps the base result (decided per group of rows): calibration never makes a linear worse on its
own data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from llmexport.quant.rtn import dequantize
from llmexport.spec import QuantizedTensor, Quantizer

#: dampening added to H's diagonal, as a fraction of its mean (the paper's 1%)
DAMPING = 0.01
#: weights rounded (and scored) at once, whole rows at a time: bounds the working copies of a
#: large lm_head
ROW_ELEMENTS = 1 << 24


def calibration_loss(w: torch.Tensor, qt: QuantizedTensor, hessian: torch.Tensor) -> float:
    """``tr((W - Q) H (W - Q)^T)``: the summed squared output error over the calibration inputs
    (fp64, ``ROW_ELEMENTS`` weights at a time: a 262,144-row lm_head whole would take gigabytes)."""
    h = hessian.double()
    oc, ic = w.shape
    step = max(1, ROW_ELEMENTS // ic)
    total = 0.0
    for start in range(0, oc, step):
        rows = slice(start, start + step)
        err = (w[rows].float() - dequantize(qt.rows(rows))).double()
        total += float(((err @ h) * err).sum())
    return total


def _inverse_factor(hessian: torch.Tensor, dead: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor of the dampened inverse Hessian (fp64 for stability)."""
    h = hessian.double().clone()
    h[dead, dead] = 1.0
    ic = h.shape[0]
    damp = DAMPING * torch.diagonal(h).mean()
    for extra in (1.0, 10.0, 100.0):
        try:
            chol = torch.linalg.cholesky(h + extra * damp * torch.eye(ic, dtype=h.dtype))
            inverse = torch.cholesky_inverse(chol)
            return torch.linalg.cholesky(inverse, upper=True)
        except RuntimeError:  # not positive definite: more dampening
            continue
    raise ValueError("the calibration Hessian is not positive definite even with 100x dampening")


#: columns rounded between two updates of the columns after them (the paper's lazy batches)
LAZY_COLUMNS = 128


@dataclass(frozen=True)
class GptqResult:
    """GPTQ's levels, their calibration loss and the base method's on the same weights."""

    levels: QuantizedTensor
    loss: float
    base_loss: float


def quantize_gptq(w: torch.Tensor, hessian: torch.Tensor, bits: int, block: int, sym: bool,
                  base: Quantizer) -> QuantizedTensor:
    """``w [oc, ic]`` rounded by GPTQ with ``hessian [ic, ic]`` on ``base``'s per-block grids;
    ``base``'s own result where that is not better (module docstring; ``gptq`` for the losses)."""
    return gptq(w, hessian, bits, block, sym, base).levels


def gptq(w: torch.Tensor, hessian: torch.Tensor, bits: int, block: int, sym: bool, base: Quantizer) -> GptqResult:
    """``quantize_gptq``'s levels with the calibration losses the choice was made on.

    Columns are rounded in batches of whole blocks (``LAZY_COLUMNS`` or one block, the larger):
    within a batch each column's error updates the batch's later columns at once, and the
    columns after the batch get the whole batch's errors in one matrix product. Rows are taken
    ``ROW_ELEMENTS`` weights at a time, each group keeping the base result where GPTQ's loss on
    it is not lower."""
    oc, ic = w.shape
    if hessian.shape != (ic, ic):
        raise ValueError(f"Hessian {tuple(hessian.shape)} does not match a weight with {ic} inputs")
    u = _inverse_factor(hessian, torch.diagonal(hessian) == 0).float()
    rows = max(1, ROW_ELEMENTS // ic)
    parts = [_rows_gptq(w[r:r + rows], hessian, u, bits, block, sym, base) for r in range(0, oc, rows)]
    levels = [p.levels for p in parts]
    return GptqResult(QuantizedTensor(torch.cat([q.q for q in levels]), torch.cat([q.scale for q in levels]),
                                      None if sym else torch.cat([cast(torch.Tensor, q.zero) for q in levels]),
                                      bits, block),
                      sum(p.loss for p in parts), sum(p.base_loss for p in parts))


def _rows_gptq(w: torch.Tensor, hessian: torch.Tensor, u: torch.Tensor, bits: int, block: int, sym: bool,
               base: Quantizer) -> GptqResult:
    """GPTQ of some rows of a linear (rows are independent given ``H``), or the base result."""
    oc, ic = w.shape
    reference = base(w, bits, block, sym)
    work = w.detach().float().clone()
    half = 1 << (bits - 1)
    nblocks = ic // block
    q = torch.empty((oc, nblocks, block), dtype=torch.int8)
    scale = torch.empty((oc, nblocks), dtype=torch.float32)
    zero = None if sym else torch.empty((oc, nblocks), dtype=torch.float32)
    batch = max(block, LAZY_COLUMNS - LAZY_COLUMNS % block)
    for b1 in range(0, ic, batch):
        b2 = min(ic, b1 + batch)
        columns, errors = work[:, b1:b2], torch.empty((oc, b2 - b1), dtype=torch.float32)
        for start in range(b1, b2, block):
            local = start - b1
            grid = base(columns[:, local:local + block].contiguous(), bits, block, sym)
            b = start // block
            scale[:, b] = s = grid.scale[:, 0]
            z = grid.zero[:, 0] if grid.zero is not None else None
            if zero is not None and z is not None:
                zero[:, b] = z
            flat = s == 0
            inverse = 1.0 / torch.where(flat, torch.ones_like(s), s)
            for i in range(local, local + block):
                column = columns[:, i]
                level = torch.round((column - (z if z is not None else 0.0)) * inverse).clamp_(-half, half - 1)
                level[flat] = 0
                q[:, b, i - local] = level.to(torch.int8)
                decoded = level * s + z if z is not None else level * s
                err = (column - decoded) / u[b1 + i, b1 + i]
                columns[:, i + 1:] -= err.unsqueeze(1) * u[b1 + i, b1 + i + 1:b2].unsqueeze(0)
                errors[:, i] = err
        if b2 < ic:
            work[:, b2:] -= errors @ u[b1:b2, b2:]
    result = QuantizedTensor(q=q, scale=scale, zero=zero, bits=bits, block=block)
    loss, base_loss = calibration_loss(w, result, hessian), calibration_loss(w, reference, hessian)
    return GptqResult(result, loss, base_loss) if loss < base_loss else GptqResult(reference, base_loss, base_loss)
