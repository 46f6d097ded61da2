"""One GGUF file opened with llama.cpp's own reader (the ``gguf`` package's ``GGUFReader``, which
memory-maps the file and checks its header, key/value section and tensor table): its metadata as
plain Python values and its tensors by GGUF name. A file the reader refuses (wrong magic, a
truncated table, an unknown value or tensor type, data past the end) is one InputError naming it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmexport.errors import InputError


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of the file: its GGUF type name, HF-order shape (``[out, in]``) and raw data
    (``[rows, bytes]`` for a quantized type, else the values)."""

    name: str
    kind: str
    shape: tuple[int, ...]
    data: np.ndarray


class GgufFile:
    """A GGUF file's metadata and tensors."""

    def __init__(self, path: Path):
        self.path = path
        try:
            from gguf import GGUFReader
        except ImportError:  # a pinned dependency: only a broken install lacks it
            raise InputError(f"{path}: reading GGUF files needs the 'gguf' package (pip install gguf)") from None
        with open(path, "rb") as handle:
            if handle.read(4) != b"GGUF":
                raise InputError(f"{path}: not a GGUF file (its first bytes are not 'GGUF')")
        try:
            reader = GGUFReader(path)
            self.metadata: dict[str, Any] = {k: f.contents() for k, f in reader.fields.items()}
            self.tensors = {t.name: GgufTensor(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)),
                                               t.data) for t in reader.tensors}
        except (ValueError, IndexError, KeyError, TypeError, OverflowError) as exc:
            raise InputError(f"{path}: not a readable GGUF file ({str(exc).splitlines()[0] or type(exc).__name__})") \
                from None
