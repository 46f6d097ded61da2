"""Block round-to-nearest quantization whose output is exactly what MNN will store.

MNN keeps per-block scales (and zeros) in fp16, so quantizing against fp32 scales and rounding
them afterwards would leave every level computed against a slightly different grid than the
one the runtime decodes with. Here scale and zero are rounded to the storage dtype *first* and
the integer levels are chosen against those rounded values; ``dequantize`` then reproduces,
bit for bit, the float path of MNN's loader (ConvolutionCommon: ``q * scale + zero`` in fp32,
``q * scale`` when symmetric, where ``q = stored - 2^(bits-1)``).

Conventions shared with the record writer:
  * ``q`` holds signed levels in ``[-2^(bits-1), 2^(bits-1) - 1]``; the byte stored on disk is
    ``q + 2^(bits-1)``.
  * asymmetric ``zero = min + 2^(bits-1) * scale``: the value of level ``q = 0``.
"""

from __future__ import annotations

from typing import Optional

import torch

from llmexport.spec import QuantizedTensor


class NonFiniteError(ValueError):
    """The values to be written hold NaN/Inf, or do not fit the storage format's range."""


def _check_args(w: torch.Tensor, bits: int, block: int) -> None:
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight [oc, ic], got shape {tuple(w.shape)}")
    if bits not in (2, 3, 4, 8):
        raise ValueError(f"RTN quantization supports 2, 3, 4 or 8 bits, got {bits}")
    ic = w.shape[1]
    if block <= 0 or ic % block != 0:
        raise ValueError(f"block {block} must be positive and divide the input width {ic}")


def _to_storage(x: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """Round to the dtype the alpha is stored in and come back to fp32."""
    return x.to(scale_dtype).to(torch.float32)


def _check_alpha(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if not torch.isfinite(t).all():
            raise NonFiniteError("quantization scale/zero overflows the storage dtype (weights too large)")


# Rows are quantized a tile of about this many values at a time on the CPU: the fp32 working
# copy then stays in cache and is reused, instead of several fresh tensor-sized temporaries
# whose first-touch page faults cost more than the arithmetic (about 4x faster end to end).
_TILE_ELEMENTS = 1 << 18


def quantize_rtn(
    w: torch.Tensor,
    bits: int,
    block: int,
    sym: bool = False,
    scale_dtype: torch.dtype = torch.float16,
) -> QuantizedTensor:
    """Quantize ``w [oc, ic]`` block-wise with round-to-nearest on the device ``w`` lives on.

    Asymmetric: the grid spans each block's [min, max]. Symmetric: ``scale = absmax /
    (2^(bits-1) - 1)`` as MNN's exporter does; the extra negative level is still usable.
    A block whose scale is zero (constant values, or a range that underflows the storage
    dtype) gets ``q = 0`` so it decodes to its zero (asym) or to 0 (sym) without dividing by 0.
    Every value is computed independently per block, so the tiling does not change the result.
    """
    _check_args(w, bits, block)
    oc, ic = w.shape
    nblocks = ic // block
    q = torch.empty((oc, nblocks, block), dtype=torch.int8, device=w.device)
    lo, hi = (torch.empty((oc, nblocks), dtype=torch.float32, device=w.device) for _ in range(2))
    scale = torch.empty_like(lo)
    zero = None if sym else torch.empty_like(lo)
    rows = oc if w.device.type != "cpu" else max(1, min(oc, _TILE_ELEMENTS // ic))
    work = torch.empty((rows, nblocks, block), dtype=torch.float32, device=w.device)
    for start in range(0, oc, rows):
        stop = min(oc, start + rows)
        _quantize_tile(w[start:stop], work[: stop - start], bits, sym, scale_dtype,
                       q[start:stop], lo[start:stop], hi[start:stop], scale[start:stop],
                       None if zero is None else zero[start:stop])
    # amin/amax propagate NaN, so checking the block extremes also rejects NaN/Inf weights.
    if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()):
        raise NonFiniteError("weight contains NaN or Inf; it cannot be quantized")
    if zero is not None:
        _check_alpha(zero)
    _check_alpha(scale)
    return QuantizedTensor(q=q, scale=scale, zero=zero, bits=bits, block=block)


def _quantize_tile(w: torch.Tensor, work: torch.Tensor, bits: int, sym: bool, scale_dtype: torch.dtype,
                   q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scale: torch.Tensor,
                   zero: Optional[torch.Tensor]) -> None:
    """Quantize rows ``w`` through the fp32 buffer ``work``, writing the outputs' matching rows."""
    offset = 1 << (bits - 1)
    qmin, qmax = -offset, offset - 1
    work.copy_(w.detach().reshape(work.shape))
    # torch.aminmax over a short last dimension is ~10x slower than amin and amax on the CPU.
    torch.amin(work, dim=-1, out=lo)
    torch.amax(work, dim=-1, out=hi)
    if sym:
        scale.copy_(_to_storage(torch.maximum(hi, -lo) / qmax, scale_dtype))
    else:
        assert zero is not None  # allocated for asymmetric quantization
        scale.copy_(_to_storage((hi - lo) / (qmax - qmin), scale_dtype))
        zero.copy_(_to_storage(lo + offset * scale, scale_dtype))
        work.sub_(zero.unsqueeze(-1))
    flat = scale == 0
    inverse = 1.0 / torch.where(flat, torch.ones_like(scale), scale)
    work.mul_(inverse.unsqueeze(-1)).round_()
    if flat.any():
        work.masked_fill_(flat.unsqueeze(-1), 0.0)
    q.copy_(work.clamp_(qmin, qmax))


def dequantize(qt: QuantizedTensor) -> torch.Tensor:
    """fp32 ``[oc, ic]`` exactly as MNN's loader computes it from the stored record."""
    levels = qt.q.to(torch.float32)
    w = levels * qt.scale.unsqueeze(-1)
    if qt.zero is not None:
        w = w + qt.zero.unsqueeze(-1)
    oc, ic = qt.shape
    return w.reshape(oc, ic)
