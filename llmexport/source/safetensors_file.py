"""One safetensors file: its header parsed and checked, and each tensor read lazily from disk.

The header is checked when read (dtypes, shapes, and byte ranges that tile the data section
exactly, as the format requires); a tensor's bytes are read only when asked for.
"""

from __future__ import annotations

import os
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from llmexport.errors import InputError
from llmexport.source.input_files import SAFETENSORS_HEADER_LIMIT, open_regular, parse_json
from llmexport.spec import rows_at

_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2), "I64": (torch.int64, 8), "I32": (torch.int32, 4),
    "I16": (torch.int16, 2), "I8": (torch.int8, 1), "U8": (torch.uint8, 1), "BOOL": (torch.bool, 1),
    "U32": (torch.uint32, 4),
}


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (``torch.int64`` -> "I64")."""
    return next((name for name, (d, _) in _DTYPES.items() if d == dtype), str(dtype))


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: file, dtype, shape and byte range inside the data section."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def parse_header(path: Path) -> dict[str, TensorEntry]:
    fd = open_regular(path, "safetensors file")
    try:
        size = os.fstat(fd).st_size
        raw_len = os.pread(fd, 8, 0)
        if len(raw_len) != 8:
            raise InputError(f"{path}: truncated safetensors file (no header length)")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > SAFETENSORS_HEADER_LIMIT or 8 + header_len > size:
            raise InputError(f"{path}: corrupt safetensors header (length {header_len} exceeds file size {size})")
        raw = os.pread(fd, header_len, 8)
    except OSError as exc:
        raise InputError(f"{path}: cannot read safetensors file ({exc.strerror})") from None
    finally:
        os.close(fd)
    try:
        header = parse_json(raw, str(path))
    except InputError as exc:
        raise InputError(f"{path}: corrupt safetensors header (not valid JSON: {str(exc).split(': ', 1)[1]})") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: corrupt safetensors header (expected a JSON object)")
    data_start = 8 + header_len
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _entry(path, name, info, data_start, size)
    _check_tiling(path, entries, data_start, size)
    return entries


def _check_tiling(path: Path, entries: dict[str, TensorEntry], data_start: int, size: int) -> None:
    """The byte ranges must follow each other without gap or overlap and end with the file (the
    safetensors format's rule): overlapping ranges would alias one tensor's bytes as another's."""
    position = data_start
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != position:
            kind = "overlaps the tensor before it" if entry.begin < position else "leaves a gap before it"
            offsets = [entry.begin - data_start, entry.end - data_start]
            raise InputError(f"{path}: tensor {name!r} byte range {offsets} {kind} (safetensors data offsets "
                             "must be contiguous and non-overlapping)")
        position = entry.end
    if position != size:
        raise InputError(f"{path}: safetensors data section has {size - data_start} bytes but its tensors "
                         f"cover {position - data_start}")


def _entry(path: Path, name: str, info: Any, data_start: int, size: int) -> TensorEntry:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise InputError(f"{path}: corrupt safetensors header entry for {name!r}")
    if not isinstance(info["dtype"], str) or info["dtype"] not in _DTYPES:
        raise InputError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']!r} "
                         f"(expected one of {', '.join(sorted(_DTYPES))})")
    dtype, itemsize = _DTYPES[info["dtype"]]
    shape, offsets = info["shape"], info["data_offsets"]
    if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
            or not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)):
        raise InputError(f"{path}: corrupt safetensors header entry for {name!r} (shape/offsets)")
    numel = 1
    for d in shape:
        numel *= d
    begin, end = data_start + offsets[0], data_start + offsets[1]
    if end - begin != numel * itemsize or begin < data_start:
        raise InputError(f"{path}: tensor {name!r} byte range {offsets} disagrees with dtype "
                         f"{info['dtype']} and shape {shape}")
    if end > size:
        raise InputError(f"{path}: truncated safetensors file (tensor {name!r} ends at byte {end}, "
                         f"file has {size})")
    return TensorEntry(path, dtype, tuple(shape), begin, end)


class LazyTensor:
    """A tensor left on disk: reads all of it, some rows of it, or row chunks, on demand.

    Reads go through ``pread`` into private buffers rather than a memory map, so what the
    process holds is exactly what it asked for: a 5 GB table streamed in 64 MB chunks never
    becomes 5 GB of resident pages.
    """

    def __init__(self, entry: TensorEntry, name: str = ""):
        self.entry, self.name = entry, name
        self.shape = torch.Size(entry.shape)
        self.dtype = entry.dtype

    @property
    def row_bytes(self) -> int:
        rows = self.shape[0] if self.shape else 1
        return self.entry.nbytes // max(rows, 1)

    def _read(self, begin: int, size: int, shape: tuple[int, ...]) -> torch.Tensor:
        buf = bytearray(size)
        try:
            with self.entry.file.open("rb", buffering=0) as f:
                view, done = memoryview(buf), 0
                while done < size:
                    got = os.preadv(f.fileno(), [view[done:]], begin + done)
                    if got <= 0:
                        raise InputError(f"{self.entry.file}: file shrank while reading")
                    done += got
        except OSError as exc:
            raise InputError(f"{self.entry.file}: cannot read tensor {self.name!r} ({exc.strerror or exc})") from None
        if size == 0:
            return torch.empty(shape, dtype=self.dtype)
        return torch.frombuffer(buf, dtype=torch.uint8).view(self.dtype).view(shape)

    def read(self) -> torch.Tensor:
        return self._read(self.entry.begin, self.entry.nbytes, tuple(self.shape))

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) along the first dimension."""
        stop = min(stop, self.shape[0])
        return self._read(self.entry.begin + start * self.row_bytes, (stop - start) * self.row_bytes,
                          (stop - start, *self.shape[1:]))

    def row_chunks(self, max_bytes: int = 64 << 20) -> Iterator[torch.Tensor]:
        """Consecutive row blocks of about ``max_bytes``; the next block is read on a worker
        thread while the caller works on the current one (at most two blocks in memory)."""
        from concurrent.futures import ThreadPoolExecutor

        step = max(1, max_bytes // max(self.row_bytes, 1))
        starts = list(range(0, self.shape[0], step))
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmexport-rows") as pool:
            pending = pool.submit(self.rows, starts[0], starts[0] + step) if starts else None
            for i in range(len(starts)):
                assert pending is not None  # one read is in flight for every start
                block = pending.result()
                pending = pool.submit(self.rows, starts[i + 1], starts[i + 1] + step) if i + 1 < len(starts) else None
                yield block

    def take(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows at ``ids`` (an embedding lookup), in order."""
        return rows_at(self.rows, ids)


class WholeLazy(LazyTensor, ABC):
    """An importer's HF tensor that is decoded whole (``read``, fp32): rows and row chunks are
    slices of it (GPTQ packs along the input axis, AWQ mixes output columns within a word, GGUF
    permutes q/k rows)."""

    shape: torch.Size
    dtype = torch.float32

    @property
    def row_bytes(self) -> int:
        return max(1, int(np.prod(self.shape[1:], dtype=np.int64)) * 4)

    @abstractmethod
    def read(self) -> torch.Tensor: ...

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return self.read()[start:stop]

    def row_chunks(self, max_bytes: int = 64 << 20) -> Iterator[torch.Tensor]:
        value = self.read()
        step = max(1, max_bytes // self.row_bytes)
        for start in range(0, self.shape[0], step):
            yield value[start:start + step]
