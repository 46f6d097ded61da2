"""Reading the user's files defensively: regular files only, bounded sizes, strict JSON.

A checkpoint folder is untrusted input. A FIFO or a device in place of ``config.json`` must not
hang or exhaust memory, a 100,000-deep nested array must not overflow the parser's stack, and a
number that does not fit a float (``1e400``) or the constants ``NaN``/``Infinity`` must not slip
into the model. Every failure is an ``InputError`` naming the file.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from llmexport.errors import InputError

KIB, MIB = 1 << 10, 1 << 20
#: size limits of the small files of a checkpoint (real ones are far smaller)
CONFIG_LIMIT = 16 * MIB
INDEX_LIMIT = 64 * MIB
TOKENIZER_LIMIT = 512 * MIB
#: a safetensors header (the JSON before the tensors; real ones are well under 1 MiB)
SAFETENSORS_HEADER_LIMIT = 100 * MIB
#: deepest nesting accepted in a JSON file (real configs and tokenizers stay under 10)
MAX_DEPTH = 64


def open_regular(path: Path, what: str = "file") -> int:
    """A read-only descriptor of ``path``, which must be (a symlink to) a regular file.

    Opened non-blocking, so a FIFO without a writer answers at once instead of hanging, then
    checked with ``fstat`` (the checked object is the one that was opened).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        if os.path.islink(path):
            raise InputError(f"{path}: {what} is a broken symbolic link") from None
        raise InputError(f"{path}: {what} is missing") from None
    except IsADirectoryError:
        raise InputError(f"{path}: {what} is a folder, expected a regular file") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read {what} ({exc.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
        raise InputError(f"{path}: {what} is {kind}, expected a regular file")
    os.set_blocking(fd, True)
    return fd


def check_regular(path: Path, what: str = "file") -> int:
    """The size of ``path`` after checking that it is a readable regular file."""
    fd = open_regular(path, what)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def read_bytes(path: Path, limit: int, what: str = "file") -> bytes:
    """The whole content of a regular file no larger than ``limit`` bytes."""
    fd = open_regular(path, what)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise InputError(f"{path}: {what} has {size} bytes, more than the {limit >> 20} MiB expected")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise InputError(f"{path}: cannot read {what} ({exc.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > limit:  # grew while being read
        raise InputError(f"{path}: {what} is larger than the {limit >> 20} MiB expected")
    return data


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} does not fit a 64-bit float")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _depth_exceeds(value: Any, limit: int) -> bool:
    """True when ``value`` nests lists/objects deeper than ``limit`` (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def parse_json(data: bytes | str, where: str) -> Any:
    """Strict JSON: UTF-8, no NaN/Infinity, finite numbers, at most ``MAX_DEPTH`` levels deep."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        value = json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)
    except UnicodeDecodeError as exc:
        raise InputError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: malformed JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise InputError(f"{where}: JSON nested too deeply") from None
    except ValueError as exc:  # _finite_float, _no_constant, int digit limits
        raise InputError(f"{where}: malformed JSON ({exc})") from None
    if isinstance(value, (dict, list)) and _depth_exceeds(value, MAX_DEPTH):
        raise InputError(f"{where}: JSON nested deeper than {MAX_DEPTH} levels")
    return value


def read_json(path: Path, limit: int = CONFIG_LIMIT, what: str = "file", expect: type = dict) -> Any:
    """A JSON file of at most ``limit`` bytes whose top level is of type ``expect``."""
    value = parse_json(read_bytes(path, limit, what), str(path))
    if not isinstance(value, expect):
        raise InputError(f"{path}: expected a JSON {'object' if expect is dict else expect.__name__}")
    return value


def read_optional_json(path: Path, limit: int = CONFIG_LIMIT, what: str = "file") -> dict[str, Any] | None:
    """``read_json`` for a file that may be absent (None then); anything else there is checked."""
    if not os.path.lexists(path):
        return None
    return read_json(path, limit, what)
