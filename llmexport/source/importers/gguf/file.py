"""One GGUF model opened with llama.cpp's own reader (the ``gguf`` package's ``GGUFReader``, which
memory-maps a file and checks its header, key/value section and tensor table): its metadata as
plain Python values and its tensors by GGUF name. A file the reader refuses (wrong magic, a
truncated table, an unknown value or tensor type, data past the end) is one InputError naming it.

A model split into parts (``gguf-split``, or ``convert_hf_to_gguf.py --split-max-tensors`` /
``--split-max-size``) is opened from its first part, ``<name>-00001-of-0000N.gguf``: every part
carries ``split.no`` (0-based), ``split.count`` and ``split.tensors.count``, the first one the
model's metadata. The parts are found beside it by their names; each tensor lies whole in one
part. A missing, extra or inconsistent part is an error naming it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmexport.errors import InputError

#: the name of part ``no`` (1-based) of ``count`` (gguf-py's and gguf-split's shard names)
SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of the file: its GGUF type name, HF-order shape (``[out, in]``) and raw data
    (``[rows, bytes]`` for a quantized type, else the values)."""

    name: str
    kind: str
    shape: tuple[int, ...]
    data: np.ndarray


def part_name(stem: str, no: int, count: int) -> str:
    """The file name of part ``no`` (1-based) of a model split into ``count`` parts."""
    return f"{stem}-{no:05d}-of-{count:05d}.gguf"


def is_first_part(path: Path) -> bool:
    """Whether ``path`` names a whole model: a single file, or the first part of a split one."""
    match = SPLIT_NAME.match(path.name)
    return match is None or int(match["no"]) == 1


def split_parts(path: Path) -> list[Path]:
    """The files of the model whose first part (or only file) is ``path``, by their names."""
    match = SPLIT_NAME.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    if int(match["no"]) != 1:
        raise InputError(f"{path}: part {int(match['no'])} of a split GGUF model; pass its first part, "
                         f"{part_name(match['stem'], 1, count)}")
    return [path.with_name(part_name(match["stem"], no, count)) for no in range(1, count + 1)]


def _named(path: Path) -> Path:
    """``path``, or the file its chain of links leads to, up to the first name of a split part: a
    materialized folder's link leads to the first part, whose siblings lie beside it (in a hub
    snapshot, itself a link to a blob of another name)."""
    while SPLIT_NAME.match(path.name) is None and path.is_symlink():
        path = Path(os.path.normpath(path.parent / os.readlink(path)))
    return path


def _read(path: Path) -> tuple[dict[str, Any], dict[str, GgufTensor]]:
    try:
        from gguf import GGUFReader
    except ImportError:  # a pinned dependency: only a broken install lacks it
        raise InputError(f"{path}: reading GGUF files needs the 'gguf' package (pip install gguf)") from None
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
    except FileNotFoundError:
        raise InputError(f"{path}: no such GGUF file") from None
    if magic != b"GGUF":
        raise InputError(f"{path}: not a GGUF file (its first bytes are not 'GGUF')")
    try:
        reader = GGUFReader(path)
        metadata = {k: f.contents() for k, f in reader.fields.items()}
        tensors = {t.name: GgufTensor(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)), t.data)
                   for t in reader.tensors}
    except (ValueError, IndexError, KeyError, TypeError, OverflowError) as exc:
        raise InputError(f"{path}: not a readable GGUF file ({str(exc).splitlines()[0] or type(exc).__name__})") \
            from None
    return metadata, tensors


class GgufFile:
    """A GGUF model's metadata and tensors (all parts of a split one); ``path``: its (first) file."""

    def __init__(self, path: Path):
        self.path = path
        parts = split_parts(_named(path))
        self.metadata, self.tensors = _read(parts[0])
        count = self.metadata.get("split.count", 1)
        if count != len(parts) or len(parts) > 1 and self.metadata.get("split.no") != 0:
            raise InputError(f"{path}: metadata split.no {self.metadata.get('split.no')!r}, split.count "
                             f"{count!r}; its name says part 1 of {len(parts)}")
        for no, part in enumerate(parts[1:], 1):
            self._add_part(part, no, len(parts))
        total = self.metadata.get("split.tensors.count", len(self.tensors))
        if len(parts) > 1 and total != len(self.tensors):
            raise InputError(f"{path}: split.tensors.count is {total}, its {len(parts)} parts hold "
                             f"{len(self.tensors)} tensors")

    def _add_part(self, part: Path, no: int, count: int) -> None:
        metadata, tensors = _read(part)
        found = tuple(metadata.get(key) for key in _SPLIT_KEYS)
        if found != (no, count, self.metadata.get("split.tensors.count")):
            raise InputError(f"{part}: metadata {dict(zip(_SPLIT_KEYS, found))}, expected part {no} (0-based) of "
                             f"{count} with split.tensors.count {self.metadata.get('split.tensors.count')}")
        twice = sorted(set(tensors) & set(self.tensors))
        if twice:
            raise InputError(f"{part}: tensor {twice[0]!r} is in an earlier part too")
        self.tensors.update(tensors)
