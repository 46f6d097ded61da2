"""The one bit-packing routine for quantized levels.

MNN reads every quantized buffer as a single most-significant-bit-first bit stream over the
whole tensor (SplitBufToArray in source/core/ConvolutionCommon.cpp): value ``i`` occupies bits
``[i*b, (i+1)*b)`` counted from the top bit of byte 0. For 4 bits that is "first element in the
high nibble", for 8 bits one byte per value, and 2/3-bit values are packed the same way,
3-bit values straddling byte boundaries. The final byte is zero-padded.
"""

from __future__ import annotations

import math
from typing import Union

import numpy as np
import torch

ArrayLike = Union[np.ndarray, torch.Tensor]

_SUPPORTED_BITS = (2, 3, 4, 8)


def _as_uint8(values: ArrayLike, bits: int) -> np.ndarray:
    if bits not in _SUPPORTED_BITS:
        raise ValueError(f"packing supports {list(_SUPPORTED_BITS)} bits, got {bits}")
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    flat = np.ascontiguousarray(values).reshape(-1)
    # uint8 input needs only the upper bound (and none at 8 bits): one pass instead of two.
    low_ok = flat.dtype == np.uint8 or not flat.size or flat.min() >= 0
    high_ok = (flat.dtype == np.uint8 and bits == 8) or not flat.size or flat.max() < (1 << bits)
    if not (low_ok and high_ok):
        raise ValueError(f"values must lie in [0, {(1 << bits) - 1}] for {bits}-bit packing")
    return flat.astype(np.uint8, copy=False)


def _group(bits: int) -> tuple[int, int]:
    """(values, bytes) per smallest whole-byte group: 4-bit 2->1, 2-bit 4->1, 3-bit 8->3."""
    values = 8 // math.gcd(8, bits)
    return values, values * bits // 8


def pack_bits(values: ArrayLike, bits: int) -> bytes:
    """Pack unsigned levels ``0 .. 2^bits-1`` MSB-first into ``ceil(n*bits/8)`` bytes."""
    flat = _as_uint8(values, bits)
    if bits == 8:
        return flat.tobytes()
    if bits == 4:  # the common case, without the general word assembly: high nibble first
        if flat.size % 2:
            flat = np.append(flat, np.uint8(0))
        # Each pair read as one little-endian uint16 is first | second << 8; the low byte of
        # (pair << 4) | (pair >> 8) is first << 4 | second. Contiguous passes, no strided views.
        pairs = flat.view("<u2")
        return ((pairs << 4) | (pairs >> 8)).astype(np.uint8).tobytes()
    per_group, group_bytes = _group(bits)
    n = flat.size
    padded = np.zeros(-(-n // per_group) * per_group, dtype=np.uint32)
    padded[:n] = flat
    groups = padded.reshape(-1, per_group)
    # Each group of values becomes one big-endian integer of group_bytes*8 bits.
    word = np.zeros(groups.shape[0], dtype=np.uint32)
    for i in range(per_group):
        word |= groups[:, i] << np.uint32(bits * (per_group - 1 - i))
    out = np.empty((groups.shape[0], group_bytes), dtype=np.uint8)
    for j in range(group_bytes):
        out[:, j] = (word >> np.uint32(8 * (group_bytes - 1 - j))) & np.uint32(0xFF)
    return out.reshape(-1)[: (n * bits + 7) // 8].tobytes()


def unpack_bits(
    buf: Union[bytes, bytearray, memoryview, np.ndarray], bits: int, count: int
) -> np.ndarray:
    """Inverse of :func:`pack_bits`: the first ``count`` levels as uint8."""
    if bits not in _SUPPORTED_BITS:
        raise ValueError(f"unpacking supports {list(_SUPPORTED_BITS)} bits, got {bits}")
    if isinstance(buf, np.ndarray):
        raw = buf.reshape(-1).view(np.uint8)
    else:
        raw = np.frombuffer(buf, dtype=np.uint8)
    needed = (count * bits + 7) // 8
    if raw.size < needed:
        raise ValueError(f"buffer holds {raw.size} bytes, {needed} needed for {count} {bits}-bit values")
    if bits == 8:
        return raw[:count].copy()
    per_group, group_bytes = _group(bits)
    ngroups = -(-count // per_group)
    padded = np.zeros(ngroups * group_bytes, dtype=np.uint32)
    padded[:needed] = raw[:needed]
    groups = padded.reshape(ngroups, group_bytes)
    word = np.zeros(ngroups, dtype=np.uint32)
    for j in range(group_bytes):
        word |= groups[:, j] << np.uint32(8 * (group_bytes - 1 - j))
    out = np.empty((ngroups, per_group), dtype=np.uint8)
    mask = np.uint32((1 << bits) - 1)
    for i in range(per_group):
        out[:, i] = (word >> np.uint32(bits * (per_group - 1 - i))) & mask
    return out.reshape(-1)[:count].copy()
