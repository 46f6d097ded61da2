"""A HuggingFace checkpoint folder: config, tokenizer files and a lazy safetensors index.

Tensors are never loaded up front. Each safetensors header is parsed and checked when the
folder is opened (dtypes, shapes, and byte ranges that tile the data section exactly, as the
format requires); a tensor's bytes are read only when asked for, so a 30 GB checkpoint costs a
few MB to open. Shards named by an index must lie inside the folder, and the index and the
shards' headers must list the same tensors.
"""

from __future__ import annotations

import contextlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from llmexport.errors import InputError
from llmexport.input_files import (
    CONFIG_LIMIT,
    INDEX_LIMIT,
    SAFETENSORS_HEADER_LIMIT,
    TOKENIZER_LIMIT,
    open_regular,
    parse_json,
    read_json,
    read_optional_json,
)
from llmexport.spec import WeightStore, rows_at

_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2), "I64": (torch.int64, 8), "I32": (torch.int32, 4),
    "I16": (torch.int16, 2), "I8": (torch.int8, 1), "U8": (torch.uint8, 1), "BOOL": (torch.bool, 1),
    "U32": (torch.uint32, 4),
}
INDEX_FILE = "model.safetensors.index.json"


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


def _parse_header(path: Path) -> dict[str, TensorEntry]:
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


class SafetensorsIndex:
    """Lazy name -> tensor access over one or many safetensors files."""

    def __init__(self, entries: dict[str, TensorEntry], folder: Path | None = None):
        self._entries = entries
        self.folder = folder  # named in messages about its tensors

    @classmethod
    def open(cls, folder: Path) -> "SafetensorsIndex":
        index_file = folder / INDEX_FILE
        if os.path.lexists(index_file):
            return cls._open_indexed(index_file)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise InputError(f"{folder}: no *.safetensors weight files found")
        entries: dict[str, TensorEntry] = {}
        for file in files:
            for name, entry in _parse_header(file).items():
                if name in entries:
                    raise InputError(f"{file}: tensor {name!r} is also in {entries[name].file.name}")
                entries[name] = entry
        return cls(entries, folder)

    @classmethod
    def of_file(cls, file: Path) -> "SafetensorsIndex":
        """The tensors of one safetensors file (a LoRA adapter's ``adapter_model.safetensors``)."""
        return cls(_parse_header(file), file.parent)

    @classmethod
    def _open_indexed(cls, index_file: Path) -> "SafetensorsIndex":
        """Shards named by the index, which must list exactly the tensors their headers hold."""
        weight_map = _weight_map(index_file)
        entries: dict[str, TensorEntry] = {}
        for shard in sorted(set(weight_map.values())):
            file = index_file.parent / shard
            if not os.path.lexists(file):
                raise InputError(f"{file}: weight file named in {index_file.name} is missing")
            for name, entry in _parse_header(file).items():
                if weight_map.get(name) != shard:
                    where = f"lists it in {weight_map[name]!r}" if name in weight_map else "does not list it"
                    raise InputError(f"{file}: holds tensor {name!r} but {index_file.name} {where}")
                entries[name] = entry
        missing = sorted(set(weight_map) - set(entries))
        if missing:
            raise InputError(f"{index_file}: tensor {missing[0]!r} is not in its shard {weight_map[missing[0]]!r}"
                             + (f" ({len(missing)} such tensors)" if len(missing) > 1 else ""))
        return cls(entries, index_file.parent)

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

    def dtype(self, name: str) -> torch.dtype:
        return self.entry(name).dtype

    def lazy(self, name: str) -> "LazyTensor":
        return LazyTensor(self.entry(name), name)

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor as stored (dtype kept), read into fresh memory."""
        return self.lazy(name).read()


class CheckpointTensors:
    """A checkpoint's tensors as the HF reference holds them (``ReferenceTensors``): floats widened
    to fp32 (what ``from_pretrained(dtype=torch.float32)`` loads), read when asked for."""

    def __init__(self, weights: WeightStore):
        self.weights = weights

    def names(self) -> list[str]:
        return self.weights.names()

    def __contains__(self, name: str) -> bool:
        return name in self.weights

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.weights.shape(name))

    def read(self, name: str) -> torch.Tensor:
        return _widened(self.weights.tensor(name))

    def rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        return _widened(self.weights.lazy(name).take(ids))


def _widened(value: torch.Tensor) -> torch.Tensor:
    return value.float() if value.is_floating_point() else value


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory, no values);
    buffers are built as usual (rotary frequencies and other computed constants keep their values)."""
    register = torch.nn.Module.register_parameter

    def on_meta(self: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.detach().to("meta"), requires_grad=False)
        register(self, name, param)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def build_from_config(loader: Any, config: Any, **kwargs: Any) -> torch.nn.Module:
    """``loader``'s model for ``config``: an Auto class through ``from_config``, a model class
    through ``_from_config`` (which takes no ``trust_remote_code``)."""
    if not hasattr(loader, "from_config"):
        kwargs.pop("trust_remote_code", None)
    return (loader.from_config if hasattr(loader, "from_config") else loader._from_config)(config, **kwargs)


def _weight_map(index_file: Path) -> dict[str, str]:
    """The index's tensor -> shard map; every shard is a plain file name or a relative path that
    stays inside the checkpoint folder (no absolute paths, no ``..``)."""
    index = read_json(index_file, INDEX_LIMIT, "safetensors index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise InputError(f"{index_file}: malformed safetensors index ('weight_map' must map tensor names "
                         "to shard file names)")
    if not weight_map:
        raise InputError(f"{index_file}: 'weight_map' lists no tensors")
    for shard in set(weight_map.values()):
        parts = Path(shard).parts
        if (not shard or Path(shard).is_absolute() or ".." in parts or "\\" in shard or "\x00" in shard
                or not shard.endswith(".safetensors")):
            raise InputError(f"{index_file}: shard {shard!r} is not a *.safetensors file inside the "
                             "checkpoint folder")
    return weight_map


@dataclass
class Checkpoint:
    """An opened HF folder."""

    path: Path
    config: dict[str, Any]
    weights: WeightStore  # a SafetensorsIndex, or an importer's view (llmexport.importers)

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
        """``loader.from_pretrained`` on this folder, from the same safetensors the export reads
        (never a ``pytorch_model.bin`` pickle beside them). An MLX checkpoint builds the HF model
        from its config and dequantized tensors instead (llmexport.importers.mlx)."""
        return loader.from_pretrained(self.path, use_safetensors=True, **kwargs)

    def hf_config(self, trust_remote_code: bool = False) -> Any:
        """transformers' config object of this checkpoint."""
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.path, trust_remote_code=trust_remote_code)

    def empty_model(self, loader: Any, **kwargs: Any) -> torch.nn.Module:
        """``loader``'s model of this checkpoint with every parameter on the meta device, ties
        made and in eval mode: the skeleton the streamed reference fills one block at a time."""
        config = self.hf_config(bool(kwargs.get("trust_remote_code", False)))
        with meta_parameters():
            model: Any = build_from_config(loader, config, **kwargs)
        model.tie_weights()
        return model.eval()

    def tokenizer_file(self) -> Path:
        path = self.path / "tokenizer.json"
        if not os.path.lexists(path):
            raise InputError(f"{self.path}: no tokenizer.json (a HF fast tokenizer is required)")
        return path

    def check_tokenizer_side_files(self) -> None:
        """The small JSON files HF's tokenizer loader reads beside ``tokenizer.json`` must parse
        (an error names the file) before any heavy stage runs."""
        for name in ("tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
                     "added_tokens.json"):
            read_optional_json(self.path / name, TOKENIZER_LIMIT, "tokenizer file")


def read_config(folder: Path) -> dict[str, Any]:
    config_file = folder / "config.json"
    if not os.path.lexists(config_file):
        raise InputError(f"{config_file}: missing (expected a HF config.json)")
    config = read_json(config_file, CONFIG_LIMIT, "config")
    if not isinstance(config.get("model_type"), str):
        raise InputError(f"{config_file}: no 'model_type' string")
    return config
