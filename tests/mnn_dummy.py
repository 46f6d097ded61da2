"""Test utility: the smallest MNN LLM folder the 3.6.1 runtime loads, for exercising its tokenizer.

`Llm.load()` (transformers/llm/engine/src/llm.cpp) insists on a tokenizer file, `llm.mnn` and
`llm.mnn.weight`, reads an embedding table (`embeddings_bf16.bin`, vocab x hidden bf16, when no
tied embeddings are configured) and loads the graph with the inputs `input_ids`,
`attention_mask`, `position_ids`, `logits_index` and the output `logits`. The graph built here
uses all four inputs and returns all-zero logits `[1, 1, vocab]`, so `forward`/`generate` run too.

The runtime is driven in a child process (`run_mnn_script`) because it can crash at interpreter
exit; the child ends with `os._exit`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

DUMMY_HIDDEN = 4


def _build_graph(path: Path, vocab_size: int, hidden: int) -> None:
    import MNN.expr as F
    import numpy as np

    input_ids = F.placeholder([-1, 1, hidden], F.NCHW, F.float)
    input_ids.name = "input_ids"
    attention_mask = F.placeholder([-1], F.NCHW, F.float)
    attention_mask.name = "attention_mask"
    position_ids = F.placeholder([1, -1], F.NCHW, F.int)
    position_ids.name = "position_ids"
    logits_index = F.placeholder([1], F.NCHW, F.int)
    logits_index.name = "logits_index"

    pooled = F.reduce_mean(F.reshape(input_ids, [-1, hidden]), [0], True)
    weight = F.const(np.zeros(hidden * vocab_size, np.float32).tolist(), [hidden, vocab_size], F.NCHW, F.float)
    indices = F.reduce_sum(position_ids) + F.reduce_sum(logits_index)
    unused = F.reduce_sum(attention_mask) * 0.0 + F.cast(indices, F.float) * 0.0
    logits = F.reshape(F.matmul(pooled, weight) + unused, [1, 1, vocab_size])
    logits.name = "logits"
    F.save([logits], str(path))


def write_dummy_mnn_model(
    out_dir: Path,
    tokenizer_file: str,
    vocab_size: int,
    *,
    jinja: dict | None = None,
    hidden: int = DUMMY_HIDDEN,
) -> Path:
    """Write a loadable dummy model next to `out_dir/tokenizer_file`; returns config.json's path.

    `jinja` goes into llm_config.json as is (e.g. `{"chat_template": ..., "eos": ...}`).
    Building the graph imports MNN in this process; call it from a child process when the
    caller must stay free of MNN (see `run_mnn_script`).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _build_graph(out_dir / "llm.mnn", vocab_size, hidden)
    (out_dir / "llm.mnn.weight").write_bytes(b"")
    (out_dir / "embeddings_bf16.bin").write_bytes(bytes(vocab_size * hidden * 2))
    config = {
        "llm_model": "llm.mnn",
        "llm_weight": "llm.mnn.weight",
        "tokenizer_file": tokenizer_file,
        "backend_type": "cpu",
        "thread_num": 1,
        "precision": "normal",
        "memory": "normal",
    }
    llm_config = {"model_type": "gemma4", "hidden_size": hidden, "layer_nums": 1, "attention_mask": "float"}
    if jinja is not None:
        llm_config["jinja"] = jinja
    (out_dir / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    (out_dir / "llm_config.json").write_text(json.dumps(llm_config, indent=2, ensure_ascii=False), encoding="utf-8")
    return out_dir / "config.json"


def run_mnn_script(body: str, payload: dict, timeout: float = 120) -> dict:
    """Run `body` in a fresh Python process with `payload` bound to `P` and MNN.llm as `L`.

    `body` must assign a JSON-serialisable `RESULT`; the child writes it to a file and leaves
    with os._exit(0), so a crash at interpreter exit cannot fail the test.
    """
    tests_dir = Path(__file__).resolve().parent
    work = Path(payload["work_dir"])
    work.mkdir(parents=True, exist_ok=True)
    payload_path = work / "payload.json"
    result_path = work / "result.json"
    payload_path.write_text(json.dumps(payload, ensure_ascii=False), encoding="utf-8")
    if result_path.exists():
        result_path.unlink()
    script = (
        "import json, os, sys\n"
        f"sys.path.insert(0, {str(tests_dir)!r})\n"
        f"P = json.load(open({str(payload_path)!r}, encoding='utf-8'))\n"
        "import MNN.llm as L\n"
        + textwrap.dedent(body)
        + f"\njson.dump(RESULT, open({str(result_path)!r}, 'w', encoding='utf-8'), ensure_ascii=False)\n"
        "sys.stdout.flush(); sys.stderr.flush()\n"
        "os._exit(0)\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=env)
    if not result_path.exists():
        raise RuntimeError(f"MNN child process failed (rc={proc.returncode}):\n"
                           f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return json.loads(result_path.read_text(encoding="utf-8"))
