"""GGUF's quantized blocks as ``Prequantized`` integers, for the types an MNN record holds exactly.

The layouts, from llama.cpp's ``ggml-common.h`` as gguf-py's ``gguf.quants`` reads them (the
reference these decoders are tested against, block by block):

* ``Q8_0`` (34 bytes / 32 values): fp16 ``d``, 32 int8 ``x``; ``w = d * x``.
* ``Q4_0`` (18 / 32): fp16 ``d``, 16 bytes; value j < 16 is the low nibble of byte j, value
  j + 16 its high nibble; ``w = d * (q - 8)``.
* ``Q4_1`` (20 / 32): fp16 ``d``, fp16 ``m``, nibbles as Q4_0; ``w = d * q + m``.
* ``Q5_0`` (22 / 32), ``Q5_1`` (24 / 32): as Q4_0 / Q4_1 with a fifth bit per value in a u32
  (bit j of value j); ``w = d * (q - 16)`` / ``d * q + m``.
* ``Q4_K`` (144 / 256): fp16 ``d``, fp16 ``dmin``, 12 bytes of eight 6-bit scales ``sc`` and mins
  ``m``, 128 bytes of nibbles: byte i of run r (32 bytes) holds value ``64 r + i`` low and
  ``64 r + 32 + i`` high; per 32-value sub-block ``w = (d * sc) * q - (dmin * m)``.
* ``Q5_K`` (176 / 256): as Q4_K with 32 bytes of fifth bits (bit s of byte i: value ``32 s + i``).
* ``Q6_K`` (210 / 256): 128 bytes of low nibbles, 64 bytes of high bit pairs, 16 int8 scales
  ``sc``, fp16 ``d``; per 16-value block ``w = (d * sc) * (q - 32)``. In each half of 128 values,
  value ``32 j + l`` (j < 4, l < 32) has its low nibble in byte ``l + 32 (j % 2)`` of the half's 64
  (low nibble for j < 2, high for j >= 2) and its high pair at bits ``2 j`` of byte ``l`` of the
  half's 32.

Each becomes levels (unsigned ``q``), one scale and one bias per 32 values (16 for ``Q6_K``):
``w = scale * q + bias``.
``d * sc`` and ``dmin * m`` (an fp16 times a 6-bit integer) are exact in fp32, and so is every
product with a level, so ``Prequantized.dequantize`` rounds where gguf-py does, once, at the
subtraction (Q4_1, Q5_1, Q4_K, Q5_K) or never (the others): the values are bit-identical.
5- and 6-bit types are held by 8-bit records (MNN linears have no 5- or 6-bit width): the levels
are shifted so the symmetric ones stay symmetric (``Q5_0``: level ``q + 112``, bias ``-128 d``;
``Q6_K``: level ``q + 96``, scale ``d * sc``, exact in fp32, bias ``-128 d sc``), and ``Q6_K``'s
records have blocks of 16 (MNN derives a record's block from its scale count). The record stores
``q - 32`` and the runtime multiplies it by the scale: ``d * sc * (q - 32)`` has at most 24
significant bits, so it is gguf-py's value exactly (``Prequantized.dequantize`` rounds once).
``Q2_K`` and ``Q3_K`` keep their 2- and 3-bit levels in 2- and 3-bit records of block 16:
* ``Q2_K`` (84 / 256): 16 bytes of packed 4-bit scale ``sc`` (low) and min ``m`` (high) per 16
  values, 64 bytes of 2-bit levels, fp16 ``d``, ``dmin``; ``w = (d sc) q - (dmin m)``, value
  ``32 j + l`` of each half of 128 at bits ``2 j`` of byte ``l`` of the half's 32: asymmetric.
* ``Q3_K`` (110 / 256): 32 bytes of high bits, 64 bytes of low 2-bit pairs (laid out as Q2_K's),
  12 bytes of sixteen 6-bit scales, fp16 ``d``; ``w = d (sc - 32) (q - 4)`` with the high bit of
  value ``128 h + 32 j + l`` at bit ``4 h + j`` of byte ``l``: symmetric, level ``q``, bias ``-4 d (sc - 32)``.
The ``IQ*`` codebooks have no MNN record: they are dequantized
(``gguf.quants``) and quantized afresh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from llmexport.spec import Prequantized, QuantInfo

GROUP = 32


@dataclass(frozen=True)
class KeptType:
    """A GGUF type whose blocks an MNN record holds: its block bytes and values, the record's
    bits and symmetry, and its decoder ``[rows, bytes] -> (levels, scales, biases)``."""

    block_bytes: int
    block_values: int
    bits: int
    sym: bool
    decode: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]
    group: int = GROUP  # values per scale

    @property
    def info(self) -> QuantInfo:
        return QuantInfo(self.bits, self.group, self.sym)


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[..., 16 k]`` bytes -> ``[..., 32 k]``: each run of 16 bytes gives 16 low then 16 high nibbles."""
    lead = qs.shape[:-1]
    runs = qs.reshape(*lead, -1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    return (runs & np.uint8(15)).reshape(*lead, -1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's u32 of fifth bits ``[..., 4]`` -> ``[..., 32]`` (bit j of value j), as 0 or 16."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")
    return (bits << np.uint8(4)).astype(np.uint8)


def _blocks(raw: np.ndarray, size: int) -> np.ndarray:
    rows = raw.shape[0]
    return raw.reshape(rows, -1, size)


def _q8_0(raw: np.ndarray):
    b = _blocks(raw, 34)
    d = _f16(b[..., 0:2])
    levels = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return levels, d, -128.0 * d


def _q4_0(raw: np.ndarray):
    b = _blocks(raw, 18)
    d = _f16(b[..., 0:2])
    return _nibbles(b[..., 2:]), d, -8.0 * d


def _q4_1(raw: np.ndarray):
    b = _blocks(raw, 20)
    return _nibbles(b[..., 4:]), _f16(b[..., 0:2]), _f16(b[..., 2:4])


def _q5_0(raw: np.ndarray):
    b = _blocks(raw, 22)
    d = _f16(b[..., 0:2])
    q = _nibbles(b[..., 6:]) | _high_bits(b[..., 2:6])
    return q + np.uint8(112), d, -128.0 * d  # d * (q + 112) - 128 d = d * (q - 16)


def _q5_1(raw: np.ndarray):
    b = _blocks(raw, 24)
    q = _nibbles(b[..., 8:]) | _high_bits(b[..., 4:8])
    return q, _f16(b[..., 0:2]), _f16(b[..., 2:4])


def k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins of a Q4_K/Q5_K super-block's 12 bytes ``[..., 12]``."""
    lo, hi, mix = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([lo & 63, (mix & 15) | ((lo >> 2) & 48)], axis=-1)
    mn = np.concatenate([hi & 63, (mix >> 4) | ((hi >> 2) & 48)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_alpha(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per 32-value sub-block scale ``d * sc`` and bias ``-(dmin * m)`` ``[rows, subblocks]``."""
    sc, mn = k_scales(b[..., 4:16])
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    rows = b.shape[0]
    return (d * sc).reshape(rows, -1), -(dmin * mn).reshape(rows, -1)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes per super-block -> 256 values: run r of 32 bytes gives values 64r..64r+31 (low
    nibbles) and 64r+32..64r+63 (high)."""
    lead = qs.shape[:-1]
    runs = qs.reshape(*lead, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    return (runs & np.uint8(15)).reshape(*lead, 256)


def _q4_k(raw: np.ndarray):
    b = _blocks(raw, 144)
    scale, bias = _k_alpha(b)
    return _k_nibbles(b[..., 16:]).reshape(raw.shape[0], -1), scale, bias


def _q5_k(raw: np.ndarray):
    b = _blocks(raw, 176)
    scale, bias = _k_alpha(b)
    high = np.unpackbits(b[..., 16:48, None], axis=-1, bitorder="little")  # [rows, sb, 32 bytes, 8 bits]
    fifth = np.moveaxis(high, -1, -2).reshape(*b.shape[:2], 256) << np.uint8(4)
    q = _k_nibbles(b[..., 48:]) | fifth.astype(np.uint8)
    return q.reshape(raw.shape[0], -1), scale, bias


def _q6_k(raw: np.ndarray):
    b = _blocks(raw, 210)
    lead = b.shape[:2]
    low = b[..., :128].reshape(*lead, 2, 2, 32)  # [half, byte run of 32, l]
    nibbles = np.stack([low & np.uint8(15), low >> np.uint8(4)], axis=-3)  # [half, low/high, run, l]
    high = b[..., 128:192].reshape(*lead, 2, 1, 32) >> (np.arange(4, dtype=np.uint8) * 2).reshape(4, 1)
    q = nibbles.reshape(*lead, 2, 4, 32) | ((high & np.uint8(3)) << np.uint8(4))  # value 32 j + l of each half
    scale = _f16(b[..., 208:210])[..., None] * b[..., 192:208].view(np.int8).astype(np.float32)
    scale = scale.reshape(raw.shape[0], -1)
    return (q + np.uint8(96)).reshape(raw.shape[0], -1), scale, -128.0 * scale  # d sc (q + 96) - 128 d sc


def _q2_k(raw: np.ndarray):
    b = _blocks(raw, 84)
    lead = b.shape[:2]
    q = (b[..., 16:80].reshape(*lead, 2, 1, 32) >> (np.arange(4, dtype=np.uint8) * 2).reshape(4, 1)) & np.uint8(3)
    packed = b[..., 0:16]
    scale = _f16(b[..., 80:82])[..., None] * (packed & np.uint8(15))
    bias = -(_f16(b[..., 82:84])[..., None] * (packed >> np.uint8(4)))
    return q.reshape(raw.shape[0], -1), scale.reshape(raw.shape[0], -1), bias.reshape(raw.shape[0], -1)


def _q3_k_scales(s: np.ndarray) -> np.ndarray:
    """Q3_K's sixteen 6-bit scales from its 12 bytes ``[..., 12]``: low nibbles from bytes 0-7,
    high pairs from bytes 8-11 (``dequantize_row_q3_K``'s ``kmask`` shuffle)."""
    low, high = s[..., 0:8], s[..., 8:12]
    pairs = [(high >> np.uint8(2 * k)) & np.uint8(3) for k in range(4)]
    return np.concatenate([(low[..., 0:4] & 15) | (pairs[0] << 4), (low[..., 4:8] & 15) | (pairs[1] << 4),
                           (low[..., 0:4] >> 4) | (pairs[2] << 4), (low[..., 4:8] >> 4) | (pairs[3] << 4)], axis=-1)


def _q3_k(raw: np.ndarray):
    b = _blocks(raw, 110)
    lead = b.shape[:2]
    low = (b[..., 32:96].reshape(*lead, 2, 1, 32) >> (np.arange(4, dtype=np.uint8) * 2).reshape(4, 1)) & np.uint8(3)
    high = (b[..., 0:32].reshape(*lead, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(2, 4, 1)) & np.uint8(1)
    scale = _f16(b[..., 108:110])[..., None] * (_q3_k_scales(b[..., 96:108]).astype(np.float32) - 32)
    scale = scale.reshape(raw.shape[0], -1)
    return (low | high << np.uint8(2)).reshape(raw.shape[0], -1), scale, -4.0 * scale  # d (sc - 32) (q - 4)


#: GGUF type name -> how its blocks are kept
KEPT: dict[str, KeptType] = {
    "Q8_0": KeptType(34, 32, 8, True, _q8_0),
    "Q4_0": KeptType(18, 32, 4, True, _q4_0),
    "Q4_1": KeptType(20, 32, 4, False, _q4_1),
    "Q5_0": KeptType(22, 32, 8, True, _q5_0),
    "Q5_1": KeptType(24, 32, 8, False, _q5_1),
    "Q4_K": KeptType(144, 256, 4, False, _q4_k),
    "Q5_K": KeptType(176, 256, 8, False, _q5_k),
    "Q6_K": KeptType(210, 256, 8, True, _q6_k, 16),
    "Q2_K": KeptType(84, 256, 2, False, _q2_k, 16),
    "Q3_K": KeptType(110, 256, 3, True, _q3_k, 16),
}


def prequantized(kind: KeptType, raw: np.ndarray) -> Prequantized:
    """The ``Prequantized`` form of a ``[rows, bytes]`` array of ``kind``'s blocks."""
    rows = raw.shape[0]
    levels, scales, biases = kind.decode(np.array(raw, dtype=np.uint8))

    def tensor(value: np.ndarray, dtype: type) -> torch.Tensor:
        return torch.from_numpy(np.array(value, dtype=dtype).reshape(rows, -1))

    return Prequantized(tensor(levels, np.uint8), tensor(scales, np.float32), tensor(biases, np.float32),
                        kind.bits, kind.group)
