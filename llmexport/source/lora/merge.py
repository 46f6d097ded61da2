"""The merge of one LoRA delta into one checkpoint tensor, row range by row range.

``W' = W + scale * L @ R``: for a linear (``nn.Linear``, weight ``[out, in]``) ``L = B [out, r]`` and
``R = A [r, in]``; for a token table (PEFT's ``lora_embedding_A [r, vocab]`` / ``lora_embedding_B
[dim, r]``, delta ``(B @ A)^T``) ``L = A^T`` and ``R = B^T``. Rows ``[start, stop)`` of ``W'`` need rows
``[start, stop)`` of ``L`` only, so a table is merged as it streams.

The sum is computed in float64 and rounded once to the checkpoint's dtype: the export and the
HF reference of ``--verify`` read the same rounded values, and a row range computed alone
rounds like the same rows of the whole tensor (float64 leaves the rounding to the last step),
which keeps a table read in 64 MB chunks (the export) equal to one read by token ids (the
reference). PEFT's own merge adds a delta already cast to the weight's dtype (two roundings);
the two differ by at most one unit in the last place of that dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmexport.source.safetensors_file import LazyTensor
from llmexport.spec import LazyRows

#: values of one row block merged at a time (``MergedLazy.rows``; float64: 32 MiB a copy)
BLOCK_VALUES = 1 << 22
#: what a merge holds at once beside the rows it returns: the block in float64, the product, the sum
#: (and the factors, which are small)
MERGE_WORK_BYTES = 4 * 8 * BLOCK_VALUES


def merged(weight: torch.Tensor, left: torch.Tensor, right: torch.Tensor, scale: float) -> torch.Tensor:
    """``weight + scale * left @ right`` in float64, rounded once to ``weight``'s dtype."""
    delta = left.to(torch.float64) @ right.to(torch.float64)
    return (weight.to(torch.float64) + scale * delta).to(weight.dtype)


@dataclass(frozen=True)
class Delta:
    """One adapter's low-rank update of one checkpoint tensor (module doc): ``key`` is the adapter
    tensor named in messages; ``embedding``: PEFT's table layout (``A [r, rows]``, ``B [cols, r]``)."""

    key: str
    a: LazyRows
    b: LazyRows
    scale: float
    embedding: bool = False

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])

    def factors(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``L[start:stop]`` and ``R`` (module doc)."""
        if self.embedding:
            return self.a.read()[:, start:stop].T, self.b.read().T
        return self.b.rows(start, stop), self.a.read()


class _Changed(LazyTensor):
    """A checkpoint tensor the adapter changes, read (whole, by rows, in chunks, by ids) like the
    tensor it stands for; a subclass gives its rows."""

    def __init__(self, base: LazyRows):
        self.base, self.name = base, base.name
        self.shape, self.dtype = base.shape, base.dtype

    @property
    def row_bytes(self) -> int:
        return self.base.row_bytes

    def read(self) -> torch.Tensor:
        return self.rows(0, self.shape[0])


class MergedLazy(_Changed):
    """A checkpoint tensor with its delta added: every read merges just the rows it returns."""

    def __init__(self, base: LazyRows, delta: Delta):
        super().__init__(base)
        self.delta = delta

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) merged a block of ``BLOCK_VALUES`` at a time: the float64 sum of a
        262k-row lm_head, or of a 64 MiB chunk of a table, would take 8 bytes a value at once."""
        stop = min(stop, self.shape[0])
        out = torch.empty((stop - start, *self.shape[1:]), dtype=self.dtype)
        left, right = self.delta.factors(start, stop)
        step = max(1, BLOCK_VALUES // max(1, self.shape[1:].numel()))
        for first in range(start, stop, step):
            last = min(first + step, stop)
            out[first - start:last - start] = merged(self.base.rows(first, last), left[first - start:last - start],
                                                     right, self.delta.scale)
        return out


class ReplacedLazy(_Changed):
    """A checkpoint tensor the adapter carries whole (``modules_to_save``, trained biases), in the
    checkpoint's dtype."""

    def __init__(self, base: LazyRows, replacement: LazyRows):
        super().__init__(base)
        self.replacement = replacement

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return self.replacement.rows(start, min(stop, self.shape[0])).to(self.dtype)
