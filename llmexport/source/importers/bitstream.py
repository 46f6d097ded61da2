"""The bit stream that MLX, GPTQ and AWQ all pack their levels in: each row of 32-bit words is
one little-endian stream, least significant bit first, value j holding bits ``[j*bits, (j+1)*bits)``
(3-bit values straddle word boundaries). AWQ then permutes the values inside each word; that
order is the AWQ reader's business (llmexport.source.importers.gptq_awq)."""

from __future__ import annotations

import numpy as np
import torch


def unpack_levels(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Little-endian words ``[..., words]`` -> unsigned levels uint8 ``[..., words * 32 // bits]``.

    ``packed`` holds the file's bytes (a safetensors read of uint32 or int32 words), so viewing it as bytes
    gives the little-endian stream on any host."""
    raw = packed.contiguous().view(torch.uint8).numpy()
    lead = raw.shape[:-1]
    if bits == 8:
        levels = raw
    elif 8 % bits == 0:  # 2 and 4 bits: whole values per byte, the first in the low bits
        shifts = np.arange(0, 8, bits, dtype=np.uint8)
        levels = ((raw[..., None] >> shifts) & np.uint8((1 << bits) - 1)).reshape(*lead, -1)
    else:  # 3, 5, 6, 7 bits straddle bytes: regroup the little-endian bit stream
        stream = np.unpackbits(raw, axis=-1, bitorder="little")
        stream = stream.reshape(*lead, stream.shape[-1] // bits, bits)
        levels = np.packbits(stream, axis=-1, bitorder="little")[..., 0]
    return torch.from_numpy(np.ascontiguousarray(levels, dtype=np.uint8))
