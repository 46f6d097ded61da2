"""Drive MNN's LLM runtime (``MNN.llm``) and single exported graphs in a child process.

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
from typing import Any, Sequence

import numpy as np

from llmexport.errors import ConversionError


@dataclass
class RuntimeRun:
    """Logits of a teacher-forced pass and a greedy continuation from MNN's runtime."""

    forced_logits: np.ndarray  # [steps, vocab]: after the prompt, then after each forced token
    greedy_ids: list[int]
    encoded: dict[str, list[int]]  # text -> ids from the runtime's tokenizer


def run_runtime(export_dir: Path, prompt_ids: list[int], forced_ids: list[int], greedy_steps: int,
                texts: Sequence[str] = (), config: dict[str, Any] | None = None, timeout: float = 600) -> RuntimeRun:
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


@dataclass
class MediaRun:
    """A prompt with media tags (``<img>...</img>``, ``<audio>...</audio>``) run by the runtime:
    the ids its tokenizer/towers produced, teacher-forced logits and a greedy continuation."""

    ids: list[int]
    forced_logits: np.ndarray  # [steps, vocab]: after the prompt, then after each forced token
    greedy_ids: list[int]


def _run_child(request: dict[str, Any], what: str, timeout: float) -> None:
    proc = subprocess.run([sys.executable, "-m", "llmexport.mnn.runtime"], input=json.dumps(request),
                          capture_output=True, text=True, timeout=timeout, errors="replace")
    if proc.returncode != 0 or not (Path(request["out"]) / "result.json").exists():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise ConversionError(f"MNN runtime failed on {what} (exit {proc.returncode}):\n{tail}")


def run_media_prompt(export_dir: Path, prompt: str, forced_ids: list[int], greedy_steps: int,
                     config: dict[str, Any] | None = None, timeout: float = 600) -> MediaRun:
    """Run a templated prompt carrying media tags; the runtime's towers turn each tag into
    soft tokens (MNN 3.6.1 ``Omni::tokenizer_encode``). A fresh instance per pass, as for text."""
    with tempfile.TemporaryDirectory(prefix="llmexport-mnn-") as tmp:
        request = {"mode": "media", "config": str(export_dir / "config.json"), "prompt": prompt,
                   "forced": forced_ids, "greedy": greedy_steps, "set_config": config or {"thread_num": 2},
                   "out": tmp}
        _run_child(request, str(export_dir), timeout)
        meta = json.loads((Path(tmp) / "result.json").read_text())
        return MediaRun(meta["ids"], np.load(Path(tmp) / "forced.npy"), meta["greedy"])


def run_module(model: Path, inputs: list[dict[str, np.ndarray]], outputs: list[str], thread_num: int = 2,
               timeout: float = 600) -> list[dict[str, np.ndarray]]:
    """Run one exported graph (e.g. ``visual.mnn``) with fp32 activations on each of several input
    sets (one child process, one module load); returns the named outputs per input set."""
    with tempfile.TemporaryDirectory(prefix="llmexport-mnn-") as tmp:
        for r, feed in enumerate(inputs):
            for i, value in enumerate(feed.values()):
                np.save(Path(tmp) / f"in{r}_{i}.npy", value)
        request = {"mode": "module", "model": str(model), "inputs": list(inputs[0]), "outputs": outputs,
                   "runs": len(inputs), "thread_num": thread_num, "out": tmp}
        _run_child(request, str(model), timeout)
        return [{name: np.load(Path(tmp) / f"out{r}_{i}.npy") for i, name in enumerate(outputs)}
                for r in range(len(inputs))]


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


def _media_child(request: dict[str, Any]) -> None:
    out = Path(request["out"])
    model = _instance(request)
    ids = [int(i) for i in model.tokenizer_encode(request["prompt"])]
    forced = [_logits(model.forward(ids))]
    for token in request["forced"]:
        forced.append(_logits(model.forward([token])))
    np.save(out / "forced.npy", np.stack(forced))
    model = _instance(request)  # fresh instance: see module docstring
    logits = _logits(model.forward([int(i) for i in model.tokenizer_encode(request["prompt"])]))
    greedy: list[int] = []
    for _ in range(request["greedy"]):
        greedy.append(int(np.argmax(logits)))
        logits = _logits(model.forward([greedy[-1]]))
    (out / "result.json").write_text(json.dumps({"ids": ids, "greedy": greedy}))


def _module_child(request: dict[str, Any]) -> None:
    import MNN.expr as F
    import MNN.nn as nn

    out = Path(request["out"])
    module = nn.load_module_from_file(request["model"], request["inputs"], request["outputs"],
                                      precision_mode=F.PrecisionMode.Normal, memory_mode=F.MemoryMode.Normal,
                                      thread_num=int(request["thread_num"]))
    for r in range(int(request["runs"])):
        args = []
        for i in range(len(request["inputs"])):
            value = np.load(out / f"in{r}_{i}.npy")
            dtype = F.int if value.dtype.kind in "iu" else F.float
            args.append(F.const(value.astype(np.int32 if dtype == F.int else np.float32), list(value.shape), F.NCHW,
                                dtype))
        results = module.forward(args)
        for i, var in enumerate(results if isinstance(results, (list, tuple)) else [results]):
            np.save(out / f"out{r}_{i}.npy", np.array(F.convert(var, F.NCHW).read(), dtype=np.float32, copy=True))
    (out / "result.json").write_text("{}")


_MODES = {"text": _child, "media": _media_child, "module": _module_child}

if __name__ == "__main__":
    try:
        request = json.loads(sys.stdin.read())
        _MODES[request.get("mode", "text")](request)
        code = 0
    except Exception as exc:  # reported through the exit code and stderr to the parent
        print(f"runtime child failed: {exc!r}", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
