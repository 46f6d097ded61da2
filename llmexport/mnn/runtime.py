"""Drive MNN's LLM runtime (``MNN.llm``) in a child process.

The runtime can crash at interpreter exit and mis-handles a second multi-token forward on a
PLE model within one instance (MNN 3.6.1), so every request runs in a fresh child process with
a fresh instance per prompt, and the child ends with ``os._exit``. Results come back as .npy
files in a temporary folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmexport.errors import ConversionError


@dataclass
class RuntimeRun:
    """Logits of a teacher-forced pass and a greedy continuation from MNN's runtime."""

    forced_logits: np.ndarray  # [steps, vocab]: after the prompt, then after each forced token
    greedy_ids: list[int]
    encoded: dict[str, list[int]]  # text -> ids from the runtime's tokenizer


def run_runtime(export_dir: Path, prompt_ids: list[int], forced_ids: list[int], greedy_steps: int,
                texts: list[str] = (), config: dict[str, Any] | None = None, timeout: float = 600) -> RuntimeRun:
    with tempfile.TemporaryDirectory(prefix="llmexport-mnn-") as tmp:
        request = {"config": str(export_dir / "config.json"), "prompt": prompt_ids, "forced": forced_ids,
                   "greedy": greedy_steps, "texts": list(texts), "set_config": config or {"thread_num": 2},
                   "out": tmp}
        proc = subprocess.run([sys.executable, "-m", "llmexport.mnn.runtime"], input=json.dumps(request),
                              capture_output=True, text=True, timeout=timeout, errors="replace")
        result = Path(tmp) / "result.json"
        if proc.returncode != 0 or not result.exists():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise ConversionError(f"MNN runtime failed on {export_dir} (exit {proc.returncode}):\n{tail}")
        meta = json.loads(result.read_text())
        return RuntimeRun(np.load(Path(tmp) / "forced.npy"), meta["greedy"], meta["encoded"])


def _instance(request: dict[str, Any]):
    import MNN.llm as llm

    model = llm.create(request["config"])
    model.set_config(request["set_config"])
    model.load()
    return model


def _logits(var) -> np.ndarray:
    # read() can alias the runtime's output buffer, which the next forward overwrites.
    return np.array(var.read(), dtype=np.float32, copy=True).reshape(-1)


def _child(request: dict[str, Any]) -> None:
    out = Path(request["out"])
    model = _instance(request)
    forced = [_logits(model.forward(request["prompt"]))]
    for token in request["forced"]:
        forced.append(_logits(model.forward([token])))
    np.save(out / "forced.npy", np.stack(forced))
    encoded = {text: [int(i) for i in model.tokenizer_encode(text)] for text in request["texts"]}
    model = _instance(request)  # fresh instance: see module docstring
    greedy: list[int] = []
    logits = _logits(model.forward(request["prompt"]))
    for _ in range(request["greedy"]):
        token = int(np.argmax(logits))
        greedy.append(token)
        logits = _logits(model.forward([token]))
    (out / "result.json").write_text(json.dumps({"greedy": greedy, "encoded": encoded}))


if __name__ == "__main__":
    try:
        _child(json.loads(sys.stdin.read()))
        code = 0
    except Exception as exc:  # reported through the exit code and stderr to the parent
        print(f"runtime child failed: {exc!r}", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
