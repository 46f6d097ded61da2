"""Hostile and unlucky inputs, and the checks that the export refused them cleanly.

Shared by tests/test_hostile_inputs.py (one test per class) and tests/test_bad_input_fuzz.py
(property tests that generate instances of the classes).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from helpers import rewrite_safetensors_header

CLI = [sys.executable, "-c", "from llmexport.cli import main; main()"]
SENTINEL = "old export"


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative path -> sha256), to prove nothing changed."""
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.is_symlink():
            out[str(path.relative_to(folder))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def make_old_dst(parent: Path) -> Path:
    dst = parent / "dst"
    dst.mkdir(parents=True)
    (dst / "previous.txt").write_text(SENTINEL)
    return dst


def copy_model(source: Path, parent: Path, name: str = "model") -> Path:
    target = parent / name
    shutil.copytree(source, target)
    return target


def assert_refused(code: int, output: str, parent: Path, before: dict[str, str], needles=(),
                   codes=range(2, 7)) -> None:
    """A one-line ``llmexport: error:`` with a documented code (2-6), the files under ``parent``
    unchanged, and nothing new left there."""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    assert code in codes, (code, output[-3000:])
    assert len(lines) == 1 and lines[0].startswith("llmexport: error:"), output[-3000:]
    for needle in needles:
        assert needle in output, (needle, output)
    assert snapshot(parent) == before, "files changed or were left behind"
    assert not [p for p in parent.rglob(".*llmexport-*")], "staging leftovers"


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300, env: dict | None = None):
    """The CLI in a child process (hangs, signals and the working directory are real there)."""
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, **(env or {})})
    return proc.returncode, proc.stderr + proc.stdout


# --- safetensors mutations ----------------------------------------------------------------------
def tensor_names(model: Path) -> list[str]:
    data = (model / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return sorted(k for k in json.loads(data[8:8 + n]) if k != "__metadata__")


def replace_tensor(model: Path, name: str, value: torch.Tensor) -> None:
    """Rewrite model.safetensors with ``name`` replaced by ``value`` (any dtype)."""
    tensors = load_file(str(model / "model.safetensors"))
    tensors[name] = value.contiguous()
    save_file(tensors, str(model / "model.safetensors"))


def poison(model: Path, name: str, value: float, row: int = 0) -> None:
    """Put ``value`` (NaN, Inf, a huge number) into one element of tensor ``name``."""
    tensors = load_file(str(model / "model.safetensors"))
    t = tensors[name].clone()
    t.view(-1)[min(row * (t.shape[-1] if t.dim() > 1 else 1), t.numel() - 1)] = value
    tensors[name] = t
    save_file(tensors, str(model / "model.safetensors"))


def overlap_offsets(model: Path, names: list[str]) -> None:
    """Point every tensor in ``names`` at the data offsets of the first (aliased bytes)."""
    def mutate(header):
        first = header[names[0]]
        size = first["data_offsets"][1] - first["data_offsets"][0]
        for name in names[1:]:
            begin = first["data_offsets"][0]
            h = header[name]
            want = h["data_offsets"][1] - h["data_offsets"][0]
            h["data_offsets"] = [begin, begin + want] if want <= size else h["data_offsets"]
            if want > size:
                h["data_offsets"] = [0, want]
    rewrite_safetensors_header(model / "model.safetensors", mutate)


def write_index(model: Path, weight_map: dict[str, str]) -> None:
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def nested_json(depth: int) -> str:
    return "[" * depth + "]" * depth
