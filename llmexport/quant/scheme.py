"""Quantization scheme: what the user asked for, and the block a given linear really gets.

MNN derives each linear's block size from the number of stored scales, so a block does not
have to be the same for every layer; but it must divide the input width, and an asymmetric
record must never advertise ``readType == 0`` (the runtime would read its ``[zero, scale]``
pairs as symmetric scales). ``QuantScheme.block_for`` is the one place that picks a block
that satisfies both.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from llmexport.mnn.limits import BLOCKS, FP16_BITS, KEPT_BLOCKS, RECORD_BITS

# Blocks narrower than a requested one are only accepted in steps of 8 elements, so that a
# block is whole bytes at every bit width (3-bit blocks of 8 values are exactly 3 bytes).
_BLOCK_GRANULE = 8


class QuantMethod(str, Enum):
    """How the integer levels are chosen; the stored format is the same for all of them."""

    RTN = "rtn"
    HQQ = "hqq"
    #: the levels, scales and zeros of a checkpoint that is already quantized (MLX), carried over
    #: unchanged (llmexport.mlx_import.transcode); never a user choice
    STORED = "stored"


@dataclass(frozen=True)
class QuantScheme:
    """Weight quantization settings for linears.

    bits: 16 keeps weights as fp16 (no quantization); 2, 3, 4 or 8 quantize.
    block: elements sharing one scale along the input dimension; 0 = one block per output row.
    sym: symmetric (scale only) instead of asymmetric (zero and scale).
    method: how levels are chosen (round-to-nearest or HQQ).
    """

    bits: int
    block: int = 64
    sym: bool = False
    method: QuantMethod = QuantMethod.RTN

    @property
    def is_fp16(self) -> bool:
        return self.bits == FP16_BITS

    def validate(self) -> "QuantScheme":
        """Raise ValueError for settings MNN cannot store; return self so calls can chain."""
        if self.bits not in RECORD_BITS:
            raise ValueError(
                f"quantization bits must be one of {list(RECORD_BITS)} (16 = fp16), got {self.bits}"
            )
        blocks = (0, *KEPT_BLOCKS) if self.method is QuantMethod.STORED else BLOCKS  # a source's own blocks
        if self.block not in blocks:
            raise ValueError(
                f"quantization block must be one of {list(blocks)} "
                f"(0 = one block per output channel), got {self.block}"
            )
        if not isinstance(self.method, QuantMethod):
            raise ValueError(f"unknown quantization method {self.method!r}")
        return self

    def block_for(self, in_features: int) -> int:
        """Block size actually used for a linear with ``in_features`` inputs.

        Rule, in order:
          * block 0 -> ``in_features`` (one block per output row);
          * the requested block if it divides ``in_features``;
          * otherwise the largest divisor of ``in_features`` that is <= the requested block and
            a multiple of 8 (e.g. width 96 at block 64 -> 48, width 48 at block 64 -> 48);
          * if there is none (e.g. width 100 or 12), ``in_features`` itself: one block per row.
        The result always divides ``in_features`` and is >= 1, so the block count per row is
        never zero and an asymmetric record's ``readType`` (= rows * blocks) is never 0.
        """
        if in_features <= 0:
            raise ValueError(f"in_features must be positive, got {in_features}")
        requested = self.block
        if requested == 0:
            return in_features
        if in_features % requested == 0:
            return requested
        start = min(requested, in_features)
        for candidate in range(start - start % _BLOCK_GRANULE, 0, -_BLOCK_GRANULE):
            if in_features % candidate == 0:
                return candidate
        return in_features
