"""Byte-level writer for linear weights in ``llm.mnn.weight``.

Each linear becomes one record that the graph's 1x1 Convolution points at through
``external = [offset, weight_bytes, alpha_bytes, bias_bytes, 0]`` and describes with a
``quanParameter``. What MNN 3.6.1 requires of those bytes (source/core/ConvolutionCommon.cpp,
source/core/OpCommonUtils.cpp):

* quantized record (``quanParameter.type 1``):
  ``[uint8 2][oc, ic as uint16, or uint32 when either exceeds 65535]`` — the loader reads the
  dims unsigned, which is byte-identical to MNN's exporter writing int16;
  ``[uint8 n][n int8 levels]`` — the value map; n = 2^bits, written as 0 for 256. The loader
  sorts it and, when it is exactly ``-2^(b-1) .. 2^(b-1)-1``, decodes ``stored - 2^(b-1)``;
  the packed stored levels ``q + 2^(b-1)`` of ``[oc, nblocks, block]``, one MSB-first bit
  stream over the whole tensor (see llmexport.quant.pack);
  alpha in fp16: ``[zero, scale]`` per (row, block) when asymmetric, ``scale`` when symmetric;
  fp32 instead for records that carry a source's own integers (``QuantMethod.STORED``, see
  llmexport.source.importers.mlx), with ``scaleStorage FP32``: ``ConvolutionCommon::load`` then reads
  ``external[2] / 4`` fp32 values; then the fp32 bias, if any.
* fp16 record (``type 3``): raw fp16 ``[oc, ic]``, no header, no alpha; then the bias.

The loader treats a record as asymmetric exactly when ``readType != 0`` and takes the number of
blocks from the alpha byte count, so readType must be non-zero for every asymmetric record
(``QuantScheme.block_for`` guarantees at least one block per row). ``aMin`` must be non-zero for
asymmetric records: 0 makes the loader shift every zero by ``128 * scale``. ``scaleIn`` must be
0, or the loader takes the record for a PTQ one and reads the alpha as fp32.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import BinaryIO, Iterator, Optional

import numpy as np
import torch

from llmexport.quant.methods import quantizer_for
from llmexport.quant.pack import pack_bits
from llmexport.quant.rtn import NonFiniteError
from llmexport.quant.scheme import FP16_BITS, QuantMethod, QuantScheme
from llmexport.quant.transcode import transcode
from llmexport.quant.workers import map_ordered
from llmexport.spec import Precomputed, Prequantized, QuantizedTensor, Quantizer

log = logging.getLogger(__name__)


_UINT16_MAX = 65535
_CHUNK_ELEMENTS = 1 << 20  # weight values one quantization worker takes at a time


@dataclass(frozen=True)
class LinearRecord:
    """Where one linear's bytes landed and how the graph must describe them."""

    offset: int
    weight_bytes: int
    alpha_bytes: int
    bias_bytes: int
    header_bytes: int
    oc: int
    ic: int
    bits: int
    block: int
    sym: bool
    alpha_fp32: bool = False

    @property
    def shape_int32(self) -> bool:
        return self.bits != FP16_BITS and (self.oc > _UINT16_MAX or self.ic > _UINT16_MAX)

    @property
    def weight_offset(self) -> int:
        """Absolute offset of the packed levels (what a tied embedding reads)."""
        return self.offset + self.header_bytes

    @property
    def alpha_offset(self) -> int:
        return self.offset + self.weight_bytes

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.alpha_bytes + self.bias_bytes

    def external(self) -> list[int]:
        return [self.offset, self.weight_bytes, self.alpha_bytes, self.bias_bytes, 0]

    def quan_parameter(self) -> dict:
        """The Convolution2D ``quanParameter`` JSON for this record."""
        if self.bits == FP16_BITS:
            return {"type": 3}
        return {
            "quantScale": 1.0,
            "scaleIn": 0.0,
            "scaleOut": 0.0,
            "useInt32": False,
            "has_scaleInt": False,
            "shapeInt32": self.shape_int32,
            "type": 1,
            "aMaxOrBits": self.bits,
            "aMin": 0 if self.sym else 1,
            "readType": 0 if self.sym else self.oc * (self.ic // self.block),
            "weightSize": 0,
            "scaleStorage": "FP32" if self.alpha_fp32 else "FP16",
        }


def record_size(oc: int, ic: int, scheme: QuantScheme, bias: bool = False) -> int:
    """The bytes ``WeightFileWriter.write_linear`` writes for an ``[oc, ic]`` linear under ``scheme``
    (what the plan and ``--dry-run`` count; the module docstring has the layout)."""
    extra = 4 * oc if bias else 0
    if scheme.is_fp16:
        return 2 * oc * ic + extra
    block = scheme.block_for(ic)
    header = len(record_header(oc, ic, scheme.bits))
    levels = -(-oc * ic * scheme.bits // 8)
    alpha_size = 4 if scheme.method is QuantMethod.STORED else 2  # transcoded records keep fp32 alpha
    alpha = oc * (ic // block) * (1 if scheme.sym else 2) * alpha_size
    return header + levels + alpha + extra


def value_map(bits: int) -> bytes:
    """Count byte (0 standing for 256) followed by the signed levels in ascending order."""
    half = 1 << (bits - 1)
    levels = np.arange(-half, half, dtype=np.int8)
    count = levels.size if levels.size < 256 else 0
    return bytes([count]) + levels.tobytes()


def record_header(oc: int, ic: int, bits: int) -> bytes:
    """Shape block and value map that precede the packed levels."""
    wide = oc > _UINT16_MAX or ic > _UINT16_MAX
    shape = np.array([oc, ic], dtype="<u4" if wide else "<u2")
    return b"\x02" + shape.tobytes() + value_map(bits)


def _alpha_bytes(qt: QuantizedTensor, fp32: bool = False) -> bytes:
    """fp16 alpha (refusing values fp16 would round, since the reader would then disagree), or fp32."""
    if qt.zero is None:
        alpha = qt.scale.reshape(-1)
    else:
        alpha = torch.stack([qt.zero, qt.scale], dim=-1).reshape(-1)
    alpha = alpha.detach().to(torch.float32).cpu()
    if fp32:
        return alpha.numpy().astype("<f4").tobytes()
    half = alpha.to(torch.float16)
    if not torch.equal(half.to(torch.float32), alpha):
        raise ValueError("quantizer returned scales/zeros that are not exactly representable in fp16")
    return half.numpy().astype("<f2").tobytes()


def _check_quantized(qt: QuantizedTensor, oc: int, ic: int, bits: int, block: int, sym: bool) -> None:
    nblocks = ic // block
    if tuple(qt.q.shape) != (oc, nblocks, block) or qt.bits != bits or qt.block != block:
        raise ValueError(
            f"quantizer returned q {tuple(qt.q.shape)} at {qt.bits} bits / block {qt.block}; "
            f"expected {(oc, nblocks, block)} at {bits} bits / block {block}"
        )
    if qt.sym != sym:
        raise ValueError(f"quantizer returned a {'symmetric' if qt.sym else 'asymmetric'} tensor")
    half = 1 << (bits - 1)
    if qt.q.numel() and (int(qt.q.min()) < -half or int(qt.q.max()) > half - 1):
        raise ValueError(f"quantized levels fall outside [{-half}, {half - 1}]")


def finite_fp16(values: np.ndarray) -> bool:
    """True when no fp16 value is NaN or Inf (all exponent bits set), checked on the bits."""
    return not bool(np.any((values.view(np.uint16) & 0x7C00) == 0x7C00))


def _fp16_bytes(rows: torch.Tensor) -> bytes:
    """An fp16 record's bytes for some rows (written a slice at a time: a whole 262144-row lm_head
    converted at once held three copies of it beside the checkpoint's)."""
    fp16 = rows.detach().to(torch.float16).cpu().numpy().astype("<f2", copy=False)
    if not finite_fp16(fp16):
        raise NonFiniteError("weight contains NaN or Inf, or values beyond fp16's range (65504)")
    return fp16.tobytes()


def _row_slices(oc: int, ic: int) -> Iterator[slice]:
    """Slices of about ``_CHUNK_ELEMENTS`` values, a multiple of 8 rows each (whole bytes at any width)."""
    step = max(8, (_CHUNK_ELEMENTS // max(ic, 1)) // 8 * 8)
    return (slice(i, min(i + step, oc)) for i in range(0, oc, step))


def _precomputed_levels(weight: Precomputed, bits: int, block: int, sym: bool) -> QuantizedTensor:
    return weight.levels(bits, block, sym)


def _quantized_slice(weight, rows: slice, scheme: QuantScheme, block: int, quantize: Quantizer) -> tuple[bytes, bytes]:
    """Packed levels and alpha bytes of rows ``rows`` (run on a quantization worker)."""
    qt = quantize(weight[rows], scheme.bits, block, scheme.sym)
    _check_quantized(qt, rows.stop - rows.start, int(weight.shape[1]), scheme.bits, block, scheme.sym)
    return pack_bits(qt.stored(), scheme.bits), _alpha_bytes(qt, fp32=scheme.method is QuantMethod.STORED)


class WeightFileWriter:
    """Appends linear records to an open binary file and keeps the running offset."""

    def __init__(self, fileobj: BinaryIO, offset: Optional[int] = None) -> None:
        self._file = fileobj
        self.offset = fileobj.tell() if offset is None else offset

    def _write(self, data: bytes) -> int:
        written = self._file.write(data)
        written = len(data) if written is None else written
        self.offset += written
        return written

    def write_raw(self, data: bytes) -> int:
        """Append bytes that are not a linear record (e.g. norm weights); returns their offset."""
        start = self.offset
        self._write(data)
        return start

    def write_linear(
        self,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        scheme: QuantScheme,
        quantizer: Optional[Quantizer] = None,
    ) -> LinearRecord:
        """Write one ``[oc, ic]`` linear (and its bias) and describe where it went.

        ``weight`` is a tensor, or a ``Prequantized`` source: written with its own integers under
        ``QuantMethod.STORED``, dequantized and quantized afresh under any other scheme; or a
        ``Precomputed`` result (calibration), written as it is.
        """
        scheme.validate()
        if isinstance(weight, Precomputed):
            quantizer = _precomputed_levels
        elif scheme.method is QuantMethod.STORED:
            if not isinstance(weight, Prequantized):
                raise ValueError("a STORED scheme needs the source's integers (Prequantized), got a float tensor")
            quantizer = transcode
        elif isinstance(weight, Prequantized):
            weight = weight.dequantize()
        if weight.dim() != 2:
            raise ValueError(f"linear weight must be 2-D [oc, ic], got {tuple(weight.shape)}")
        oc, ic = (int(d) for d in weight.shape)
        start = self.offset
        if scheme.is_fp16:
            header_bytes, alpha_bytes, block = 0, 0, 0
            weight_bytes = sum(self._write(_fp16_bytes(weight[rows])) for rows in _row_slices(oc, ic))
        else:
            header_bytes, weight_bytes, alpha_bytes, block = self._write_quantized(weight, scheme, quantizer)
        bias_bytes = self._write_bias(bias, oc)
        return LinearRecord(
            offset=start, weight_bytes=weight_bytes, alpha_bytes=alpha_bytes, bias_bytes=bias_bytes,
            header_bytes=header_bytes, oc=oc, ic=ic, bits=scheme.bits, block=block,
            sym=scheme.sym and not scheme.is_fp16, alpha_fp32=scheme.method is QuantMethod.STORED,
        )

    def _write_quantized(
        self, weight: torch.Tensor, scheme: QuantScheme, quantizer: Optional[Quantizer]
    ) -> tuple[int, int, int, int]:
        """Header, packed levels and alpha; returns (header, header+levels, alpha, block) sizes.

        Rows are quantized in slices, in parallel on the quantization workers, which bounds memory
        on large matrices (a 262144-row lm_head); slices hold a multiple of 8 rows so each one ends
        on a byte boundary of the bit stream, and they are written in order.
        """
        oc, ic = (int(d) for d in weight.shape)
        block = scheme.block_for(ic)
        if scheme.block not in (0, block):
            log.debug("linear %dx%d: block %d does not divide %d, using %d",
                      oc, ic, scheme.block, ic, block)
        quantize = quantizer or quantizer_for(scheme.method)
        header_bytes = self._write(record_header(oc, ic, scheme.bits))
        packed_bytes, alphas = 0, []
        for packed, alpha in map_ordered(lambda rows: _quantized_slice(weight, rows, scheme, block, quantize),
                                         _row_slices(oc, ic)):
            packed_bytes += self._write(packed)
            alphas.append(alpha)
        alpha_bytes = self._write(b"".join(alphas))
        return header_bytes, header_bytes + packed_bytes, alpha_bytes, block

    def _write_bias(self, bias: Optional[torch.Tensor], oc: int) -> int:
        if bias is None:
            return 0
        if bias.numel() != oc:
            raise ValueError(f"bias has {bias.numel()} values for {oc} output channels")
        values = bias.detach().reshape(-1).to(torch.float32).cpu()
        if not bool(torch.isfinite(values).all()):
            raise NonFiniteError("bias contains NaN or Inf")
        return self._write(values.numpy().astype("<f4").tobytes())
