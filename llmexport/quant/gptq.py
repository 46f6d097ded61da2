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
keeps the base result: calibration never makes a linear worse on its own data.
"""

from __future__ import annotations

import torch

from llmexport.quant.rtn import dequantize
from llmexport.spec import QuantizedTensor, Quantizer

#: dampening added to H's diagonal, as a fraction of its mean (the paper's 1%)
DAMPING = 0.01


def calibration_loss(w: torch.Tensor, qt: QuantizedTensor, hessian: torch.Tensor) -> float:
    """``tr((W - Q) H (W - Q)^T)``: the summed squared output error over the calibration inputs."""
    err = (w.float() - dequantize(qt)).double()
    return float(((err @ hessian.double()) * err).sum())


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


def quantize_gptq(w: torch.Tensor, hessian: torch.Tensor, bits: int, block: int, sym: bool,
                  base: Quantizer) -> QuantizedTensor:
    """``w [oc, ic]`` rounded by GPTQ with ``hessian [ic, ic]`` on ``base``'s per-block grids;
    ``base``'s own result where that is not better (module docstring)."""
    oc, ic = w.shape
    if hessian.shape != (ic, ic):
        raise ValueError(f"Hessian {tuple(hessian.shape)} does not match a weight with {ic} inputs")
    reference = base(w, bits, block, sym)
    dead = torch.diagonal(hessian) == 0
    work = w.detach().double().clone()
    work[:, dead] = w.double()[:, dead]
    u = _inverse_factor(hessian, dead)
    half = 1 << (bits - 1)
    nblocks = ic // block
    q = torch.empty((oc, nblocks, block), dtype=torch.int8)
    scale = torch.empty((oc, nblocks), dtype=torch.float32)
    zero = None if sym else torch.empty((oc, nblocks), dtype=torch.float32)
    for b in range(nblocks):
        start = b * block
        grid = base(work[:, start:start + block].float(), bits, block, sym)
        scale[:, b] = grid.scale[:, 0]
        if zero is not None and grid.zero is not None:
            zero[:, b] = grid.zero[:, 0]
        s = grid.scale[:, 0].double()
        z = grid.zero[:, 0].double() if grid.zero is not None else torch.zeros_like(s)
        flat = s == 0
        inverse = 1.0 / torch.where(flat, torch.ones_like(s), s)
        for j in range(start, start + block):
            column = work[:, j]
            level = torch.round((column.float().double() - z) * inverse).clamp_(-half, half - 1)
            level[flat] = 0
            q[:, b, j - start] = level.to(torch.int8)
            decoded = (level.float() * s.float() + (z.float() if grid.zero is not None else 0.0)).double()
            err = (column - decoded) / u[j, j]
            if j + 1 < ic:
                work[:, j + 1:] -= err.unsqueeze(1) * u[j, j + 1:].unsqueeze(0)
    result = QuantizedTensor(q=q, scale=scale, zero=zero, bits=bits, block=block)
    if calibration_loss(w, result, hessian) < calibration_loss(w, reference, hessian):
        return result
    return reference
