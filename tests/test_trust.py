"""Unattended use: atomic output under failures and SIGKILL, documented exit codes, no network."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from llmexport.cli import main

from helpers import rewrite_safetensors_header

SENTINEL = "old export"


@pytest.fixture()
def old_dst(tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "previous.txt").write_text(SENTINEL)
    return dst


def _unchanged(dst: Path) -> bool:
    return sorted(p.name for p in dst.iterdir()) == ["previous.txt"] and (dst / "previous.txt").read_text() == SENTINEL


def _no_staging_left(dst: Path) -> bool:
    return not list(dst.parent.glob(f".{dst.name}.*"))


def _cli(*args: str):
    return CliRunner().invoke(main, list(args))


def test_disk_full_during_weight_write(tiny_gemma4, old_dst, monkeypatch):
    from llmexport.mnn import weights

    original = weights.WeightFileWriter._write
    calls = {"n": 0}

    def full_disk(self, data):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, data)

    monkeypatch.setattr(weights.WeightFileWriter, "_write", full_disk)
    result = _cli("--path", str(tiny_gemma4("e2b")), "--dst_path", str(old_dst))
    assert result.exit_code == 6, result.output
    assert "No space left on device" in result.output and len(result.output.strip().splitlines()) == 1
    assert _unchanged(old_dst) and _no_staging_left(old_dst)


def test_unwritable_destination(tiny_gemma4, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    result = _cli("--path", str(tiny_gemma4("e2b")), "--dst_path", str(blocker / "out"))
    assert result.exit_code == 6 and str(blocker / "out") in result.output


def test_converter_failure_shows_its_log_tail(tiny_gemma4, old_dst, monkeypatch):
    from llmexport.trace import onnx_export

    def broken_onnx(graph, inputs, path, for_mnn=True):
        path.write_bytes(b"this is not an onnx file")
        return path

    monkeypatch.setattr(onnx_export, "export_onnx", broken_onnx)
    result = _cli("--path", str(tiny_gemma4("e2b")), "--dst_path", str(old_dst))
    assert result.exit_code == 5
    assert "MNN converter failed" in result.output and "Start to Convert" in result.output
    assert _unchanged(old_dst) and _no_staging_left(old_dst)


def test_missing_tokenizer_fails_before_any_work(tiny_gemma4, tmp_path, old_dst):
    model = tmp_path / "m"
    shutil.copytree(tiny_gemma4("31b"), model)
    (model / "tokenizer.json").unlink()
    result = _cli("--path", str(model), "--dst_path", str(old_dst))
    assert result.exit_code == 3 and "tokenizer.json" in result.output
    assert _unchanged(old_dst)


def test_missing_weight_file_named_in_index(tiny_gemma4, tmp_path, old_dst):
    import json

    model = tmp_path / "m"
    shutil.copytree(tiny_gemma4("31b"), model)
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "shard-2.safetensors"}}))
    result = _cli("--path", str(model), "--dst_path", str(old_dst))
    assert result.exit_code == 3 and "shard-2.safetensors" in result.output
    assert _unchanged(old_dst)


@pytest.mark.slow
def test_whole_export_and_verify_with_sockets_disabled(tiny_gemma4, tmp_path):
    """Every Python process of the export (CLI, converter, runtime) runs with sockets refused."""
    guard = tmp_path / "guard"
    guard.mkdir()
    attempts = tmp_path / "network-attempts.txt"
    (guard / "sitecustomize.py").write_text(
        "import socket\n"
        f"_LOG = {str(attempts)!r}\n"
        "def _refuse(*args, **kwargs):\n"
        "    with open(_LOG, 'a') as f:\n"
        "        f.write(repr(args) + '\\n')\n"
        "    raise OSError('network disabled in this test')\n"
        "socket.socket.connect = _refuse\n"
        "socket.socket.connect_ex = _refuse\n"
        "socket.create_connection = _refuse\n"
        "socket.getaddrinfo = _refuse\n")
    env = {**os.environ, "PYTHONPATH": str(guard) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", "from llmexport.cli import main; main()", "--path",
                           str(tiny_gemma4("e2b")), "--dst_path", str(tmp_path / "out"), "--verify"],
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not attempts.exists(), attempts.read_text()


def _corrupt_header(model: Path, mutate) -> None:
    rewrite_safetensors_header(model / "model.safetensors", mutate)


def _shape(header, shape):
    header["lm_head.weight"]["shape"] = shape


@pytest.mark.parametrize("breakage, needle", [
    (lambda m: (m / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops"), "not valid JSON"),
    (lambda m: (m / "model.safetensors").write_bytes((m / "model.safetensors").read_bytes()[:-64]), "truncated"),
    (lambda m: _corrupt_header(m, lambda h: h["lm_head.weight"].__setitem__("dtype", "F8_E5M2")), "unsupported dtype"),
    (lambda m: _corrupt_header(m, lambda h: _shape(h, [3, 7])), "disagrees with dtype"),
    (lambda m: _corrupt_header(m, lambda h: _shape(h, [64, 512])), "config implies"),
])
def test_broken_safetensors_is_an_input_error(tiny_gemma4, tmp_path, old_dst, breakage, needle):
    model = tmp_path / "m"
    shutil.copytree(tiny_gemma4("31b"), model)
    breakage(model)
    result = _cli("--path", str(model), "--dst_path", str(old_dst))
    assert result.exit_code == 3, result.output
    assert needle in result.output and len(result.output.strip().splitlines()) == 1
    assert _unchanged(old_dst) and _no_staging_left(old_dst)
