"""Embedding / PLE tables in the layout MNN 3.6.1's DiskEmbedding reads.

Facts from transformers/llm/engine/src/diskembedding.cpp (tag 3.6.1), in our words:

* bf16 (bits 16): the raw bf16 table ``[rows, dim]``; the runtime widens each value by putting
  it in the upper half of an fp32.
* int8 / int4: all rows' packed levels first (row stride ``dim * bits / 8`` bytes, no padding;
  4-bit pairs with the first value in the high nibble), then the alpha. The stored level is
  the unsigned ``q + 2^(bits-1)`` (0..255 / 0..15). Alpha is fp32 unless the config says fp16
  (only a tied lm_head record carries fp16 alpha); ``[zero, scale]`` per (row, block) when its
  size is twice rows*blocks (asymmetric, what this module writes), ``scale`` alone otherwise.
  The runtime first folds the offset into the zero, ``zero' = zero - 2^(bits-1) * scale`` (fp32),
  then decodes ``value = stored * scale + zero'``. With ``zero = min + 2^(bits-1) * scale`` this is
  the same value the linear records decode to, up to fp32 rounding of the different formula.
* The table is split into blocks of the one configured ``quant_block`` (0 = whole row); the
  runtime computes ``dim / block`` blocks, so a block must divide ``dim`` exactly and span
  whole bytes.
* Only 8 bits uses the 8-bit routine; every other width goes through the 4-bit routine, so
  2- and 3-bit tables decode to garbage and are refused here.
* ``ple_quant = [a, b, alpha_bytes, bits, block]`` is parsed as (weight offset, *alpha offset*,
  alpha size, ...); a weight offset of 0 selects the PLE file, anything else llm.mnn.weight.
  A PLE table must therefore start at byte 0 of its own file, and then b = weight_bytes.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import BinaryIO, Iterable, Optional, Union

import numpy as np
import torch

from llmexport.mnn.limits import BLOCKS, TABLE_BITS
from llmexport.quant.pack import pack_bits
from llmexport.quant.rtn import NonFiniteError, quantize_rtn
from llmexport.quant.workers import map_ordered
from llmexport.spec import Quantizer

TableSource = Union[torch.Tensor, Iterable[torch.Tensor]]

_CHUNK_ELEMENTS = 1 << 22  # rows per chunk are chosen to keep about this many values in flight
_SLICE_ELEMENTS = 1 << 20  # values one quantization worker takes at a time
_SPOOL_BYTES = 64 << 20

_fp32_rtn: Quantizer = functools.partial(quantize_rtn, scale_dtype=torch.float32)


@dataclass(frozen=True)
class EmbeddingRecord:
    """Sizes of a written table; ``block`` is the block actually used (dim for 0)."""

    weight_bytes: int
    alpha_bytes: int
    bits: int
    block: int
    rows: int = 0
    dim: int = 0

    def ple_quant(self) -> list[int]:
        """``llm_config.json``'s ``ple_quant`` for a table written at offset 0 of its file."""
        return [0, self.weight_bytes, self.alpha_bytes, self.bits, self.block]


def table_size(rows: int, dim: int, bits: int, block: int) -> int:
    """The bytes ``write_embedding_table`` writes for a ``[rows, dim]`` table (fp32 ``[zero, scale]``
    per row and block after the packed levels; bf16 at 16 bits)."""
    if bits == 16:
        return rows * dim * 2
    used = dim if block == 0 else block
    return rows * dim * bits // 8 + rows * (dim // used) * 2 * 4


def resolve_block(dim: int, bits: int, block: int) -> int:
    """Validate ``bits``/``block`` for a table of width ``dim``; return the block to use."""
    if bits not in TABLE_BITS:
        raise ValueError(
            f"embedding tables support {list(TABLE_BITS)} bits; MNN 3.6.1 decodes other widths "
            f"with its 4-bit routine, got {bits}"
        )
    if bits == 16:
        return 0
    used = dim if block == 0 else block
    if used <= 0 or dim % used != 0 or (used * bits) % 8 != 0:
        valid = [b for b in BLOCKS if (b == 0 or dim % b == 0) and ((b or dim) * bits) % 8 == 0]
        raise ValueError(
            f"block {block} does not split an embedding of width {dim} into whole-byte blocks "
            f"at {bits} bits; valid blocks: {valid}"
        )
    return used


def _row_chunks(table: TableSource) -> Iterable[torch.Tensor]:
    if isinstance(table, torch.Tensor):
        if table.dim() != 2:
            raise ValueError(f"embedding table must be 2-D, got {tuple(table.shape)}")
        step = max(1, _CHUNK_ELEMENTS // max(1, table.shape[1]))
        return (table[i: i + step] for i in range(0, table.shape[0], step))
    return iter(table)


def _check_chunk(chunk: torch.Tensor, dim: Optional[int]) -> int:
    if chunk.dim() != 2 or (dim is not None and chunk.shape[1] != dim):
        raise ValueError(f"row chunk of shape {tuple(chunk.shape)} does not match width {dim}")
    return int(chunk.shape[1])


def _bf16_bytes(chunk: torch.Tensor) -> bytes:
    raw = chunk.detach().to(torch.bfloat16).cpu().contiguous().view(torch.int16).numpy()
    if np.any((raw & 0x7F80) == 0x7F80):  # all exponent bits set: NaN or Inf
        raise NonFiniteError("table contains NaN or Inf")
    return raw.astype("<i2").tobytes()


def _quantized_rows(chunk: torch.Tensor, bits: int, block: int, quantizer: Quantizer) -> tuple[bytes, bytes]:
    qt = quantizer(chunk, bits, block, False)
    if qt.zero is None:
        raise ValueError("embedding quantizer must be asymmetric (zero and scale)")
    alpha = torch.stack([qt.zero, qt.scale], dim=-1).reshape(-1).to(torch.float32).cpu()
    return pack_bits(qt.stored(), bits), alpha.numpy().astype("<f4").tobytes()


def _quantized_chunk(chunk: torch.Tensor, bits: int, block: int, quantizer: Quantizer) -> tuple[bytes, bytes]:
    """Packed levels and alpha of a row chunk, its row slices quantized on the workers (rows are
    whole bytes at 4 and 8 bits, so the slices' bytes simply follow each other)."""
    step = max(1, _SLICE_ELEMENTS // max(1, int(chunk.shape[1])))
    parts = list(map_ordered(lambda start: _quantized_rows(chunk[start: start + step], bits, block, quantizer),
                             range(0, int(chunk.shape[0]), step)))
    return b"".join(p for p, _ in parts), b"".join(a for _, a in parts)


def write_embedding_table(
    fileobj: BinaryIO,
    table: TableSource,
    bits: int,
    block: int,
    quantizer: Optional[Quantizer] = None,
) -> EmbeddingRecord:
    """Write a ``[rows, dim]`` table (a tensor or an iterable of row chunks) at the file position.

    Levels are written chunk by chunk; the alpha, which must follow *all* levels, is spooled to a
    temporary file meanwhile, so memory stays bounded by one chunk whatever the table size.
    """
    rows, dim, weight_bytes, used = 0, None, 0, None
    with tempfile.SpooledTemporaryFile(max_size=_SPOOL_BYTES) as spool:
        for chunk in _row_chunks(table):
            dim = _check_chunk(chunk, dim)
            if used is None:
                used = resolve_block(dim, bits, block)
            if bits == 16:
                data, alpha = _bf16_bytes(chunk), b""
            else:
                data, alpha = _quantized_chunk(chunk, bits, used, quantizer or _fp32_rtn)
            weight_bytes += fileobj.write(data) or len(data)
            spool.write(alpha)
            rows += int(chunk.shape[0])
        if dim is None:
            raise ValueError("embedding table is empty")
        alpha_bytes = spool.tell()
        spool.seek(0)
        shutil.copyfileobj(spool, fileobj)
    return EmbeddingRecord(weight_bytes, alpha_bytes, bits, used or 0, rows, dim)


def _decode_levels(raw: np.ndarray, bits: int, rows: int, dim: int) -> np.ndarray:
    """Unsigned stored levels [rows, dim], unpacked the way the runtime's routines do."""
    if bits == 8:
        return raw.reshape(rows, dim).astype(np.float32)
    high, low = raw >> 4, raw & 0x0F
    return np.stack([high, low], axis=-1).reshape(rows, dim).astype(np.float32)


def read_embedding_table(
    path: Union[str, os.PathLike],
    rows: int,
    dim: int,
    bits: int,
    block: int,
    offset: int = 0,
    alpha_dtype: torch.dtype = torch.float32,
    alpha_bytes: Optional[int] = None,
    row_range: Optional[tuple[int, int]] = None,
) -> torch.Tensor:
    """Decode a table (or the rows ``row_range = (start, stop)`` of it) to fp32 exactly as
    DiskEmbedding does.

    ``alpha_dtype`` fp16 and ``offset`` past a record header read a tied lm_head record;
    ``alpha_bytes`` (default: the asymmetric size) lets the runtime's symmetric branch be used.
    """
    start, stop = row_range if row_range is not None else (0, rows)
    if not 0 <= start <= stop <= rows:
        raise ValueError(f"row range {start}..{stop} is outside a table of {rows} rows")
    count = stop - start
    if bits == 16:
        raw = np.fromfile(path, dtype="<u2", count=count * dim, offset=offset + start * dim * 2).astype(np.uint32)
        if raw.size != count * dim:
            raise ValueError("embedding file is shorter than rows/dim imply")
        return torch.from_numpy((raw << 16).view(np.float32).reshape(count, dim))
    used = resolve_block(dim, bits, block)
    nblocks = dim // used
    weight_len = rows * dim * bits // 8
    elem = 2 if alpha_dtype == torch.float16 else 4
    alpha_len = alpha_bytes if alpha_bytes is not None else rows * nblocks * 2 * elem
    per_row = alpha_len // elem // rows  # alpha values per row: nblocks (symmetric) or 2 * nblocks
    if per_row not in (nblocks, 2 * nblocks) or alpha_len != rows * per_row * elem:
        raise ValueError(f"{alpha_len // elem} alpha values fit neither layout for {rows}x{nblocks} blocks")
    row_bytes = dim * bits // 8
    raw = np.fromfile(path, dtype=np.uint8, count=count * row_bytes, offset=offset + start * row_bytes)
    alpha = np.fromfile(path, dtype="<f2" if elem == 2 else "<f4", count=count * per_row,
                        offset=offset + weight_len + start * per_row * elem).astype(np.float32)
    if raw.size != count * row_bytes or alpha.size != count * per_row:
        raise ValueError("embedding file is shorter than rows/dim/bits/block imply")
    stored = _decode_levels(raw, bits, count, dim).reshape(count * nblocks, used)
    shift = np.float32(-(1 << (bits - 1)))
    if per_row == nblocks:
        scale, zero = alpha, shift * alpha
    else:
        scale = alpha[1::2]
        zero = alpha[0::2] + scale * shift
    values = stored * scale[:, None] + zero[:, None]
    return torch.from_numpy(values.reshape(count, dim))
