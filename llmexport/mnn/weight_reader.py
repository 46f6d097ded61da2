"""Independent decoder for linear records in ``llm.mnn.weight``.

It re-implements, from the bytes alone, what MNN 3.6.1's loader does for a 1x1 Convolution
with external data (source/core/ConvolutionCommon.cpp, ``ConvolutionCommon::load`` and
``IDSTDecoder::ReadQuanData_c``; bias per source/core/OpCommonUtils.cpp). It deliberately
shares no code with the writer side (no rtn/pack imports), so a writer bug cannot hide behind
a reader that makes the same mistake.

Decoding, as the runtime does it:
  * header: dims count byte, dims as uint16 (uint32 if ``shapeInt32``), a count byte
    (0 = 256) and that many int8 map entries, sorted ascending;
  * levels: ``ceil(bits * oc * ic / 8)`` bytes read as one MSB-first bit stream; each index
    selects a map entry (for the usual linear map this is ``stored - 2^(bits-1)``);
  * alpha: fp16 or fp32 per ``scaleStorage``; asymmetric iff ``readType != 0``;
    blocks per row = alpha count (halved when asymmetric) / oc;
  * value = level * scale + zero (asymmetric) or level * scale (symmetric), in fp32.
"""

from __future__ import annotations

import math
import os
from typing import Callable, Optional, Union

import numpy as np
import torch

Source = Union[str, os.PathLike, bytes, bytearray, memoryview]


def _read_span(src: Source, offset: int, size: int) -> bytes:
    if isinstance(src, (bytes, bytearray, memoryview)):
        data = bytes(src[offset: offset + size])
    else:
        with open(src, "rb") as f:
            f.seek(offset)
            data = f.read(size)
    if len(data) != size:
        raise ValueError(f"record wants {size} bytes at offset {offset}, only {len(data)} available")
    return data


def _bits_from_count(count: int) -> int:
    bits = count.bit_length() - 1
    if count <= 1 or (1 << bits) != count:
        raise ValueError(f"value map of {count} entries is not a power of two")
    return bits


def _split_stream(raw: np.ndarray, bits: int, count: int) -> np.ndarray:
    """MSB-first bit stream -> ``count`` unsigned indices: byte by byte when ``bits`` divides 8 (the
    first index in the high bits), else bit by bit (the same stream, read the slow way)."""
    if 8 % bits == 0:
        per_byte = 8 // bits
        shifts = np.arange(8 - bits, -1, -bits, dtype=np.uint8)
        wanted = raw[: -(-count // per_byte)]
        return ((wanted[:, None] >> shifts) & np.uint8((1 << bits) - 1)).reshape(-1)[:count]
    stream = np.unpackbits(raw)[: count * bits].reshape(count, bits).astype(np.int32)
    index = np.zeros(count, dtype=np.int32)
    for column in range(bits):
        index = (index << 1) | stream[:, column]
    return index


def _parse_header(blob: bytes, shape_int32: bool, oc: int, ic: int) -> tuple[np.ndarray, int, int]:
    """A record's header: its value map (int32, ascending), the bit width and where the packed
    levels start."""
    if blob[0] != 2:
        raise ValueError(f"expected a 2-D shape header, found {blob[0]} dims")
    dim_dtype, dim_size = ("<u4", 4) if shape_int32 else ("<u2", 2)
    dims = np.frombuffer(blob, dtype=dim_dtype, count=2, offset=1)
    if (int(dims[0]), int(dims[1])) != (oc, ic):
        raise ValueError(f"header shape {tuple(int(d) for d in dims)} != expected {(oc, ic)}")
    pos = 1 + 2 * dim_size
    count = blob[pos] or 256
    table = np.sort(np.frombuffer(blob, dtype=np.int8, count=count, offset=pos + 1)).astype(np.int32)
    pos += 1 + count
    bits = _bits_from_count(count)
    packed_size = -(-bits * oc * ic // 8)
    if len(blob) - pos != packed_size:
        raise ValueError(f"record has {len(blob) - pos} packed bytes, {packed_size} expected")
    return table, bits, pos


def _parse_levels(blob: bytes, shape_int32: bool, oc: int, ic: int) -> tuple[np.ndarray, int]:
    """Header + packed levels -> signed levels [oc*ic] (int32) and the bit width."""
    table, bits, pos = _parse_header(blob, shape_int32, oc, ic)
    return table[_split_stream(np.frombuffer(blob, dtype=np.uint8, offset=pos), bits, oc * ic)], bits


def _check_quant_flags(qp: dict, asym: bool, oc: int, nblocks: int) -> None:
    """Fields the loader reacts to that a well-formed llmexport record must hold."""
    if float(qp.get("quantScale", 1.0)) != 1.0 or qp.get("has_scaleInt", False):
        raise ValueError("quantScale must be 1.0 and has_scaleInt false")
    if float(qp.get("scaleIn", 0.0)) != 0.0:
        raise ValueError("scaleIn != 0 makes the loader read alpha as PTQ fp32")
    if asym and int(qp.get("readType", 0)) != oc * nblocks:
        raise ValueError(f"readType {qp.get('readType')} != rows*blocks {oc * nblocks}")
    if asym and int(qp.get("aMin", 0)) <= 0:
        raise ValueError("aMin <= 0 on an asymmetric record shifts every zero in the loader")


def _alpha(alpha_raw: bytes, qp: dict) -> np.ndarray:
    """fp16 alpha when ``scaleStorage`` is FP16, else fp32 (the schema default; records that carry
    a source's own integers use it), widened to fp32."""
    alpha_dtype = "<f2" if qp.get("scaleStorage", "FP32") == "FP16" else "<f4"
    return np.frombuffer(alpha_raw, dtype=alpha_dtype).astype(np.float32)


#: levels decoded at a time: the bit stream is split into int32 columns, so a whole 262,144 x 2,560
#: record at once would take 10 GiB beside its 2.7 GB of floats
_CHUNK_VALUES = 1 << 22


def _level_decoder(table: np.ndarray, bits: int) -> Callable[[np.ndarray, int], torch.Tensor]:
    """Packed bytes -> the first ``count`` levels as floats (``table``: the value map). Where ``bits``
    divides 8 each byte holds whole levels (MSB first): a map of consecutive integers (what the
    writer stores) is an offset added to the bytes' bit fields, on torch's threads; any other map a
    lookup per byte in a 256-row table of its values. Otherwise the bit stream is split."""
    if 8 % bits:
        return lambda raw, count: torch.from_numpy(table[_split_stream(raw, bits, count)].astype(np.float32))
    per_byte, mask = 8 // bits, (1 << bits) - 1
    if np.array_equal(np.diff(table), np.ones(len(table) - 1, dtype=table.dtype)):
        offset = float(table[0])

        def fields(raw: np.ndarray, count: int) -> torch.Tensor:
            packed = torch.from_numpy(raw[: -(-count // per_byte)])
            parts = [(packed >> shift) & mask for shift in range(8 - bits, -1, -bits)]
            levels = torch.stack(parts, dim=1).reshape(-1)[:count] if per_byte > 1 else packed
            return levels.to(torch.float32).add_(offset)
        return fields
    every_byte = np.arange(256, dtype=np.uint8)
    by_byte = torch.from_numpy(table.astype(np.float32)[_split_stream(every_byte, bits, 256 * per_byte)]
                               .reshape(256, per_byte))
    return lambda raw, count: by_byte[torch.from_numpy(raw[: -(-count // per_byte)]).long()].reshape(-1)[:count]


def _decode_quantized(blob: memoryview, alpha_raw: memoryview, qp: dict, oc: int, ic: int,
                      strict: bool) -> torch.Tensor:
    table, bits, pos = _parse_header(blob, bool(qp.get("shapeInt32", False)), oc, ic)
    if bits != int(qp.get("aMaxOrBits", bits)):
        raise ValueError(f"value map says {bits} bits, aMaxOrBits says {qp.get('aMaxOrBits')}")
    alpha = _alpha(alpha_raw, qp)
    asym = int(qp.get("readType", 0)) != 0
    groups = alpha.size // 2 if asym else alpha.size
    if groups == 0 or (oc * ic) % groups != 0 or groups % oc != 0:
        raise ValueError(f"{alpha.size} alpha values do not fit a [{oc}, {ic}] weight")
    if strict:
        _check_quant_flags(qp, asym, oc, groups // oc)
    if asym:
        zero, scale = alpha[0::2].copy(), alpha[1::2]
        clamp_min = -128.0 if int(qp.get("aMin", 0)) == 0 else float(qp["aMin"])
        if clamp_min < 0:
            zero = zero - np.float32(clamp_min) * scale
    else:
        zero, scale = None, alpha
    size = oc * ic // groups
    packed = np.frombuffer(blob, dtype=np.uint8, offset=pos)
    out = torch.empty((groups, size), dtype=torch.float32)
    scales = torch.from_numpy(np.ascontiguousarray(scale))[:, None]
    zeros = None if zero is None else torch.from_numpy(zero)[:, None]
    decode = _level_decoder(table, bits)
    # chunks of whole groups whose first level starts on a byte (8 levels span ``bits`` bytes)
    step = max(1, _CHUNK_VALUES // size) * (8 // math.gcd(8, size))
    for first in range(0, groups, step):
        last = min(first + step, groups)
        begin = first * size * bits // 8
        chunk = decode(packed[begin: -(-last * size * bits // 8)], (last - first) * size).view(last - first, size)
        torch.mul(chunk, scales[first:last], out=out[first:last])
        if zeros is not None:
            out[first:last] += zeros[first:last]
    return out.view(oc, ic)


def read_linear(
    src: Source,
    external: list,
    quan_parameter: dict,
    oc: int,
    ic: int,
    strict: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Decode one record to (fp32 weight [oc, ic], fp32 bias [oc] or None).

    ``strict`` additionally rejects flag values the runtime would accept but mis-decode
    (readType that does not match the alpha count, aMin 0 on an asymmetric record, ...).
    """
    offset, weight_len, alpha_len, bias_len = (int(v) for v in external[:4])
    # writable, so that torch can view the packed levels without a warning (they are only read)
    record = bytearray(_read_span(src, offset, weight_len + alpha_len + bias_len))
    view = memoryview(record)
    blob, alpha_raw = view[:weight_len], view[weight_len: weight_len + alpha_len]
    kind = int(quan_parameter.get("type", 0))
    if kind == 3:
        if weight_len != oc * ic * 2:
            raise ValueError(f"fp16 record holds {weight_len} bytes, {oc * ic * 2} expected")
        weight = torch.from_numpy(np.frombuffer(blob, dtype="<f2").astype(np.float32).reshape(oc, ic))
    elif kind == 1:
        weight = _decode_quantized(blob, alpha_raw, quan_parameter, oc, ic, strict)
    else:
        raise ValueError(f"unsupported quanParameter type {kind}")
    bias = None
    if bias_len:
        if bias_len != 4 * oc:
            raise ValueError(f"bias holds {bias_len} bytes, {4 * oc} expected")
        bias = torch.from_numpy(np.frombuffer(record[weight_len + alpha_len:], dtype="<f4").copy())
    return weight.contiguous(), bias


def read_levels(src: Source, external: list, quan_parameter: dict, oc: int, ic: int) -> tuple[np.ndarray, np.ndarray]:
    """A quantized record as stored: signed levels ``[oc, ic]`` (int32, ``stored - 2^(bits-1)``)
    and its alpha in fp32 (``[zero, scale]`` pairs when asymmetric)."""
    offset, weight_len, alpha_len = (int(v) for v in external[:3])
    record = _read_span(src, offset, weight_len + alpha_len)
    levels, _ = _parse_levels(record[:weight_len], bool(quan_parameter.get("shapeInt32", False)), oc, ic)
    return levels.reshape(oc, ic), _alpha(record[weight_len:], quan_parameter)
