"""Calibration text for ``--calib_data``: read from a file on disk, tokenized, cut into windows.

The file is plain UTF-8 text, or JSONL whose lines are objects with a string ``"text"`` (or plain
JSON strings); a ``.jsonl`` suffix, or a first non-blank line that parses as such, selects JSONL.
The texts are tokenized with the checkpoint's tokenizer (no special tokens), joined, and cut into
``samples`` windows of ``seq_len`` tokens spread evenly over the whole text. Bad input is an
``InputError`` naming the file: missing, empty, binary (NUL bytes or not UTF-8), JSONL lines of
another shape, or fewer tokens than one window.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from llmexport.errors import InputError
from llmexport.options import Calibration

#: the largest calibration file read (the text is held in memory while it is tokenized)
MAX_BYTES = 256 << 20


def read_texts(path: Path, flag: str = "--calib_data") -> list[str]:
    """The texts of ``path`` (module docstring); errors name ``flag`` (``--verify_text`` reads the same formats)."""
    where = f"{flag} {path}"
    if not path.is_file():
        raise InputError(f"{where}: no such file")
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise InputError(f"{where}: {size} bytes; at most {MAX_BYTES} are read (use a smaller sample)")
    data = path.read_bytes()
    if b"\0" in data:
        raise InputError(f"{where}: binary file (NUL bytes); expected UTF-8 text or JSONL")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{where}: not UTF-8 text (byte {exc.start}); expected UTF-8 text or JSONL") from None
    if not text.strip():
        raise InputError(f"{where}: empty; expected UTF-8 text or JSONL")
    lines = [line for line in text.splitlines() if line.strip()]
    if path.suffix == ".jsonl" or _json_text(lines[0]) is not None:
        return [_jsonl_text(line, number, where) for number, line in enumerate(lines, 1)]
    return [text]


def _json_text(line: str) -> str | None:
    try:
        value: Any = json.loads(line)
    except ValueError:
        return None
    if isinstance(value, dict) and isinstance(value.get("text"), str):
        return value["text"]
    return value if isinstance(value, str) else None


def _jsonl_text(line: str, number: int, where: str) -> str:
    text = _json_text(line)
    if text is None:
        raise InputError(f"{where}: line {number} is not a JSON string or an object with a string \"text\"")
    return text


def calibration_windows(tokenizer: Any, texts: list[str], calibration: Calibration) -> torch.Tensor:
    """``[samples, seq_len]`` token ids: windows spread evenly over the tokenized texts (fewer
    windows than asked when the text is short, at least one)."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
    length = calibration.seq_len
    where = f"--calib_data {calibration.data}"
    if len(ids) < length:
        raise InputError(f"{where}: {len(ids)} tokens; --calib_seq_len {length} needs at least {length}")
    windows = min(calibration.samples, len(ids) // length)
    step = (len(ids) - length) // max(1, windows - 1) if windows > 1 else 0
    starts = [i * step for i in range(windows)]
    return torch.tensor([ids[s:s + length] for s in starts], dtype=torch.long)
