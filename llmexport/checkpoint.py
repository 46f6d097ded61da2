"""A HuggingFace checkpoint folder: config, tokenizer files and a lazy safetensors index.

Tensors are never loaded up front. Each safetensors header is parsed and checked (dtype,
offsets, file size) when the folder is opened; a tensor's bytes are memory-mapped and turned
into a torch tensor only when asked for, so a 30 GB checkpoint costs a few MB to open.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from llmexport.errors import InputError

_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2), "I64": (torch.int64, 8), "I32": (torch.int32, 4),
    "I16": (torch.int16, 2), "I8": (torch.int8, 1), "U8": (torch.uint8, 1), "BOOL": (torch.bool, 1),
    "U32": (torch.uint32, 4),
}
_MAX_HEADER = 100 * 1024 * 1024


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


def _parse_header(path: Path) -> dict[str, TensorEntry]:
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise InputError(f"{path}: truncated safetensors file (no header length)")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > _MAX_HEADER or 8 + header_len > size:
                raise InputError(f"{path}: corrupt safetensors header (length {header_len} exceeds file size {size})")
            header = json.loads(f.read(header_len))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: corrupt safetensors header (not valid JSON: {exc})") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read safetensors file ({exc.strerror})") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: corrupt safetensors header (expected a JSON object)")
    data_start = 8 + header_len
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _entry(path, name, info, data_start, size)
    return entries


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

    def __init__(self, entry: TensorEntry):
        self.entry = entry
        self.shape = torch.Size(entry.shape)
        self.dtype = entry.dtype

    @property
    def row_bytes(self) -> int:
        rows = self.shape[0] if self.shape else 1
        return self.entry.nbytes // max(rows, 1)

    def _read(self, begin: int, size: int, shape: tuple[int, ...]) -> torch.Tensor:
        buf = bytearray(size)
        with self.entry.file.open("rb", buffering=0) as f:
            view, done = memoryview(buf), 0
            while done < size:
                got = os.preadv(f.fileno(), [view[done:]], begin + done)
                if got <= 0:
                    raise InputError(f"{self.entry.file}: file shrank while reading")
                done += got
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
                block = pending.result()
                pending = pool.submit(self.rows, starts[i + 1], starts[i + 1] + step) if i + 1 < len(starts) else None
                yield block

    def take(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows at ``ids`` (an embedding lookup), in order."""
        return torch.stack([self.rows(int(i), int(i) + 1)[0] for i in ids.reshape(-1)])


class SafetensorsIndex:
    """Lazy name -> tensor access over one or many safetensors files."""

    def __init__(self, entries: dict[str, TensorEntry]):
        self._entries = entries

    @classmethod
    def open(cls, folder: Path) -> "SafetensorsIndex":
        index_file = folder / "model.safetensors.index.json"
        if index_file.exists():
            files = _files_from_index(index_file)
        else:
            files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise InputError(f"{folder}: no *.safetensors weight files found")
        entries: dict[str, TensorEntry] = {}
        for file in files:
            if not file.exists():
                raise InputError(f"{file}: weight file named in {index_file.name} is missing")
            entries.update(_parse_header(file))
        return cls(entries)

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def entry(self, name: str) -> TensorEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise InputError(f"checkpoint has no tensor {name!r}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entry(name).shape

    def lazy(self, name: str) -> "LazyTensor":
        return LazyTensor(self.entry(name))

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor as stored (dtype kept), read into fresh memory."""
        return self.lazy(name).read()


def _files_from_index(index_file: Path) -> list[Path]:
    try:
        weight_map = json.loads(index_file.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise InputError(f"{index_file}: malformed safetensors index ({exc})") from None
    return [index_file.parent / name for name in sorted(set(weight_map.values()))]


@dataclass
class Checkpoint:
    """An opened HF folder."""

    path: Path
    config: dict[str, Any]
    weights: SafetensorsIndex

    @classmethod
    def open(cls, path: Path | str) -> "Checkpoint":
        folder = Path(path)
        if not folder.exists():
            raise InputError(f"{folder}: model path does not exist")
        if not folder.is_dir():
            raise InputError(f"{folder}: model path is not a folder")
        return cls(folder, read_config(folder), SafetensorsIndex.open(folder))

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", ""))

    def from_pretrained(self, loader: Any, **kwargs: Any) -> Any:
        """``loader.from_pretrained`` on this folder (an MLX checkpoint builds the HF model from its
        config and dequantized tensors instead: llmexport.mlx_import)."""
        return loader.from_pretrained(self.path, **kwargs)

    def tokenizer_file(self) -> Path:
        path = self.path / "tokenizer.json"
        if not path.exists():
            raise InputError(f"{self.path}: no tokenizer.json (a HF fast tokenizer is required)")
        return path


def read_config(folder: Path) -> dict[str, Any]:
    config_file = folder / "config.json"
    if not config_file.exists():
        raise InputError(f"{config_file}: missing (expected a HF config.json)")
    try:
        config = json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{config_file}: malformed JSON ({exc})") from None
    if not isinstance(config, dict):
        raise InputError(f"{config_file}: expected a JSON object")
    if not isinstance(config.get("model_type"), str):
        raise InputError(f"{config_file}: no 'model_type' string")
    return config
