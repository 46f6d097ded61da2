"""Test data: real tokenizer vocabularies (and Gemma4's real chat template) from PyPI.

The llama-cpp-python sdist vendors llama.cpp's ``models/ggml-vocab-*.gguf`` files: vocabulary-only
GGUF files converted from HF tokenizers, several with ``.inp``/``.out`` tokenization cases (texts
and the ids HF's tokenizer produced for them). ``ggml-vocab-gemma-4.gguf`` carries Gemma4's
vocabulary and its chat template (``tokenizer.chat_template``).

The sdist is fetched once with pip (``pip download``, the ordinary PyPI client) into a cache
folder, its SHA-256 checked, and only the requested ``ggml-vocab-*`` members are extracted.
Cache folder: ``$LLMEXPORT_TEST_DATA`` if set, else ``~/.cache/llmexport-test-data``. A lock file
keeps concurrent test processes from downloading twice.

GGUF metadata is read by ``read_gguf_metadata`` below (a small reader written from the GGUF
format description: little-endian header ``GGUF``, u32 version, u64 tensor and key/value counts,
then typed key/value pairs); the ``gguf`` package is not needed.
"""

from __future__ import annotations

import fcntl
import functools
import os
import struct
import subprocess
import sys
import tarfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from llmexport.planning.digests import file_sha256

SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
SDIST_FILE = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
MODELS_DIR = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/"
CASE_SEPARATOR = "\n__ggml_vocab_test__\n"


def cache_dir() -> Path:
    """Where the sdist and the extracted vocabularies live (created on demand)."""
    root = os.environ.get("LLMEXPORT_TEST_DATA") or str(Path.home() / ".cache" / "llmexport-test-data")
    path = Path(root).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    with open(folder / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)



def sdist_path() -> Path:
    """The llama-cpp-python sdist, downloaded with pip on first use and verified by SHA-256."""
    folder = cache_dir()
    target = folder / SDIST_FILE
    with _locked(folder):
        if not target.exists():
            # pip prepares the sdist's metadata (its build backend in an isolated environment);
            # nothing is compiled.
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   f"{SDIST_NAME}=={SDIST_VERSION}", "-d", str(folder), "--quiet"]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0 or not target.exists():
                raise RuntimeError(f"pip download of {SDIST_NAME}=={SDIST_VERSION} failed "
                                   f"(rc={proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        got = file_sha256(target)
        if got != SDIST_SHA256:
            target.unlink()
            raise RuntimeError(f"{target}: SHA-256 {got} is not the pinned {SDIST_SHA256}; removed, run again")
    return target


def vocab_names() -> list[str]:
    """Names ``X`` of the sdist's ``ggml-vocab-X.gguf`` files."""
    with tarfile.open(sdist_path()) as tar:
        names = [m.name[len(MODELS_DIR):] for m in tar.getmembers() if m.name.startswith(MODELS_DIR)]
    return sorted(n[len("ggml-vocab-"):-len(".gguf")] for n in names
                  if n.startswith("ggml-vocab-") and n.endswith(".gguf"))


@dataclass(frozen=True)
class RealVocab:
    """One extracted vocabulary: the GGUF file and, when the sdist has them, its test cases."""

    name: str
    gguf: Path
    inp: Path | None
    out: Path | None

    @functools.cached_property
    def metadata(self) -> dict[str, Any]:
        return read_gguf_metadata(self.gguf)

    def cases(self) -> list[tuple[str, list[int]]]:
        """(text, ids) pairs of the ``.inp``/``.out`` files (llama.cpp's test-tokenizer-0 format:
        texts separated by ``CASE_SEPARATOR``, one line of space-separated ids per text)."""
        if self.inp is None or self.out is None:
            return []
        return parse_cases(self.inp.read_bytes().decode("utf-8"), self.out.read_bytes().decode("utf-8"))


def parse_cases(inp: str, out: str) -> list[tuple[str, list[int]]]:
    texts = inp.split(CASE_SEPARATOR)
    if len(texts) > 1 and texts[-1] == "":  # most files end each text with the separator
        texts.pop()
    lines = out.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(texts) != len(lines):
        raise ValueError(f"{len(texts)} texts but {len(lines)} id lines")
    return [(text, [int(t) for t in line.split()]) for text, line in zip(texts, lines)]


@functools.lru_cache(maxsize=None)
def real_vocab(name: str) -> RealVocab:
    """``ggml-vocab-{name}.gguf`` (+ ``.inp``/``.out``) extracted from the sdist into the cache."""
    folder = cache_dir() / "vocab"
    folder.mkdir(exist_ok=True)
    stem = f"ggml-vocab-{name}.gguf"
    wanted = {stem: folder / stem, stem + ".inp": folder / (stem + ".inp"), stem + ".out": folder / (stem + ".out")}
    if not wanted[stem].exists():
        sdist = sdist_path()
        with _locked(cache_dir()), tarfile.open(sdist) as tar:
            members = {m.name[len(MODELS_DIR):]: m for m in tar.getmembers()
                       if m.name.startswith(MODELS_DIR) and m.isfile()}
            if stem not in members:
                raise KeyError(f"{SDIST_FILE} has no {stem}; it has {sorted(members)}")
            for member, dest in wanted.items():
                if member in members and not dest.exists():
                    source = tar.extractfile(members[member])
                    assert source is not None
                    part = dest.with_suffix(dest.suffix + ".part")
                    part.write_bytes(source.read())
                    part.replace(dest)
    return RealVocab(name, wanted[stem], *(p if p.exists() else None for p in (wanted[stem + ".inp"],
                                                                               wanted[stem + ".out"])))


# --- GGUF metadata ---------------------------------------------------------------------------

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Reader:
    def __init__(self, data: bytes):
        self.data = memoryview(data)
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.data):
            raise ValueError(f"string of {n} bytes runs past the end of the file at offset {self.pos}")
        text = bytes(self.data[self.pos:self.pos + n]).decode("utf-8")
        self.pos += n
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.unpack("<I"), self.unpack("<Q")
            if item_kind in _SCALARS:  # one struct call for the whole run
                fmt = _SCALARS[item_kind]
                size = struct.calcsize(fmt)
                values = list(struct.unpack_from(f"<{count}{fmt[1]}", self.data, self.pos))
                self.pos += size * count
                return values
            return [self.value(item_kind) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind} at offset {self.pos}")
        return self.unpack(_SCALARS[kind])


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """The key/value metadata of a GGUF file (versions 2 and 3), in file order; tensors are not read."""
    reader = _Reader(Path(path).read_bytes())
    if bytes(reader.data[:4]) != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    reader.pos = 4
    version = reader.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    reader.unpack("<Q")  # tensor count
    count = reader.unpack("<Q")
    metadata: dict[str, Any] = {"GGUF.version": version}
    for _ in range(count):
        key = reader.string()
        metadata[key] = reader.value(reader.unpack("<I"))
    return metadata


def gemma4_chat_template() -> str:
    """Gemma4's real chat template (``tokenizer.chat_template`` of ``ggml-vocab-gemma-4.gguf``)."""
    template = real_vocab("gemma-4").metadata["tokenizer.chat_template"]
    assert isinstance(template, str)
    return template


def sdist_template(name: str) -> str:
    """``models/templates/{name}.jinja`` of the sdist (llama.cpp's copies of HF chat templates,
    fetched by its scripts/get_chat_template.py), extracted once into the cache."""
    folder = cache_dir() / "templates"
    folder.mkdir(exist_ok=True)
    dest = folder / f"{name}.jinja"
    if not dest.exists():
        sdist = sdist_path()
        with _locked(cache_dir()), tarfile.open(sdist) as tar:
            source = tar.extractfile(f"{MODELS_DIR}templates/{name}.jinja")
            assert source is not None
            part = dest.with_suffix(".part")
            part.write_bytes(source.read())
            part.replace(dest)
    return dest.read_bytes().decode("utf-8")


def qwen3_5_chat_template() -> str:
    """Qwen3.5's real chat template (HF ``Qwen/Qwen3.5-4B``, llama.cpp's ``Qwen3.5-4B.jinja``). The
    ``tokenizer.chat_template`` of ``ggml-vocab-qwen35.gguf`` is not it: that file carries a plain
    ChatML template (no thinking, no tools)."""
    return sdist_template("Qwen3.5-4B")
