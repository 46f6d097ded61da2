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

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class QuantizedTensor:
    """Quantized ``[oc, ic]`` weight as ``[oc, nblocks, block]`` levels plus per-block alpha."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: Optional[torch.Tensor]
    bits: int
    block: int

    @property
    def sym(self) -> bool:
        return self.zero is None

    @property
    def shape(self) -> tuple[int, int]:
        oc, nblocks, block = self.q.shape
        return oc, nblocks * block

    def stored(self) -> torch.Tensor:
        """Unsigned on-disk levels ``q + 2^(bits-1)`` as uint8, same shape as ``q``."""
        if self.bits == 8:  # q + 128 overflows int8; flipping the sign bit is the same mapping
            return self.q.view(torch.uint8) ^ 0x80
        return (self.q + (1 << (self.bits - 1))).view(torch.uint8)


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
    """
    _check_args(w, bits, block)
    oc, ic = w.shape
    offset = 1 << (bits - 1)
    qmin, qmax = -offset, offset - 1
    wb = w.detach().to(torch.float32).reshape(oc, ic // block, block)
    # amin/amax propagate NaN, so checking the block extremes also rejects NaN/Inf weights.
    lo, hi = torch.aminmax(wb, dim=-1)
    if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()):
        raise NonFiniteError("weight contains NaN or Inf; it cannot be quantized")
    if sym:
        scale = _to_storage(torch.maximum(hi, -lo) / qmax, scale_dtype)
        zero = None
    else:
        scale = _to_storage((hi - lo) / (qmax - qmin), scale_dtype)
        zero = _to_storage(lo + offset * scale, scale_dtype)
        _check_alpha(zero)
    _check_alpha(scale)
    flat = scale == 0
    inverse = 1.0 / torch.where(flat, torch.ones_like(scale), scale)
    levels = wb if zero is None else wb - zero.unsqueeze(-1)
    levels = levels.mul_(inverse.unsqueeze(-1)) if levels is not wb else levels * inverse.unsqueeze(-1)
    levels = levels.round_()
    if flat.any():
        levels.masked_fill_(flat.unsqueeze(-1), 0.0)
    q = levels.clamp_(qmin, qmax).to(torch.int8)
    return QuantizedTensor(q=q, scale=scale, zero=zero, bits=bits, block=block)


def dequantize(qt: QuantizedTensor) -> torch.Tensor:
    """fp32 ``[oc, ic]`` exactly as MNN's loader computes it from the stored record."""
    levels = qt.q.to(torch.float32)
    w = levels * qt.scale.unsqueeze(-1)
    if qt.zero is not None:
        w = w + qt.zero.unsqueeze(-1)
    oc, ic = qt.shape
    return w.reshape(oc, ic)
