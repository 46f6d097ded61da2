"""The sha256 of the export's files for manifest.json, computed while they are written.

Hashing the finished files afterwards read the whole export again (2.0 s of a 17 s export of a
35-layer E2B-shaped model, docs/benchmarks.md). The large files (the weight files and the token
table) are instead written through ``HashingWriter``, which hashes each block as it passes:
hashlib releases the GIL over large buffers, so the hash runs while the quantization workers
compute the next slices. ``FileDigests`` keeps those digests; the manifest takes a digest from it
only when the file still has the size and modification time it had when its writer closed, and
hashes every other file (configs, tokenizer, small graphs) from disk.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
from pathlib import Path
from typing import Any

_BLOCK = 1 << 20


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in 1 MiB blocks (the manifest's, and what tests and benches check)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(_BLOCK), b""):
            digest.update(chunk)
    return digest.hexdigest()


class FileDigests:
    """Digests of files written through ``HashingWriter``, keyed by path (thread-safe)."""

    def __init__(self) -> None:
        self._known: dict[Path, tuple[tuple[int, int], str]] = {}
        self._lock = threading.Lock()

    def open(self, path: Path) -> "HashingWriter":
        """``path`` opened for writing ("wb"), its digest recorded here when the writer closes."""
        return HashingWriter(path, self)

    def record(self, path: Path, digest: str) -> None:
        with self._lock:
            self._known[path.resolve()] = (_identity(path), digest)

    def sha256(self, path: Path) -> str:
        """The recorded digest if the file is unchanged since its writer closed, else hashed from disk."""
        with self._lock:
            known = self._known.get(path.resolve())
        if known is not None and known[0] == _identity(path):
            return known[1]
        return file_sha256(path)


class HashingWriter(io.BufferedWriter):
    """A binary file opened for writing whose every written byte also goes into a sha256.

    Only appends are hashed: a ``seek`` (which nothing in the export does) voids the running
    digest, and the file is then hashed from disk for the manifest like any other."""

    def __init__(self, path: Path, digests: FileDigests):
        super().__init__(io.FileIO(path, "wb"), buffer_size=_BLOCK)
        self.path, self._digests = path, digests
        self._hash: Any = hashlib.sha256()
        self._length = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = super().write(view)
        if self._hash is not None:
            self._hash.update(view[:written])
            self._length += written
        return written

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._hash = None
        return super().seek(offset, whence)

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        if self._hash is not None and self._length == self.path.stat().st_size:
            self._digests.record(self.path, self._hash.hexdigest())

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None:  # a failed write: nothing to record
            self._hash = None
        self.close()


def _identity(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns
