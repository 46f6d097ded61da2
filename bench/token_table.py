"""How a per-layer-embedding export reaches MNN's runtime: PLE as its own input vs PLE rows in the token table.

    python bench/token_table.py NAME=EXPORT_DIR [NAME=EXPORT_DIR ...] [--reps 3] [--threads 2]
                                [--prompt 64] [--decode 32]

Each export folder is run in fresh child processes, ``--reps`` times interleaved (medians
reported, ratios against the first folder), all in this one run:
- load: wall time of ``create`` + ``load``;
- prefill tokens/s of a ``--prompt``-token forward and decode tokens/s of ``--decode`` one-token
  forwards (wall time around the calls; ``get_context`` is not used: MNN 3.6.1's binding has
  crashed reading it after long generations);
- peak resident memory of the child (``ru_maxrss``) after load and after decoding;
- correctness of a conversation, on the exact kernels (``memory: normal``): a second multi-token
  forward after a decode step, in the same instance, against a fresh instance fed the whole
  history (max |dlogit|; "error" when the runtime refuses the forward).
The folder with PLE as its own input is the export of commit 54eb756 and earlier (a checkout
of it exports with ``python -m llmexport.cli``); the current exporter writes the token table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, os, resource, sys, time
import numpy as np
import MNN.llm as llm

config, settings, prompt, decode = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])

def instance():
    m = llm.create(config)
    m.set_config(settings)
    m.load()
    return m

def logits(var):
    return np.array(var.read(), dtype=np.float32, copy=True).reshape(-1)

def rss_gib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

out = {}
start = time.perf_counter()
m = instance()
out["load_s"] = time.perf_counter() - start
out["rss_load_gib"] = rss_gib()
ids = list(range(10, 10 + prompt))
start = time.perf_counter()
token = int(logits(m.forward(ids)).argmax())
out["prefill_tok_s"] = prompt / (time.perf_counter() - start)
start = time.perf_counter()
for _ in range(decode):
    token = int(logits(m.forward([token])).argmax())
out["decode_tok_s"] = decode / (time.perf_counter() - start)
out["rss_decode_gib"] = rss_gib()
second = list(range(300, 300 + prompt // 2))
m.reset()
history = ids[:prompt // 2]
logits(m.forward(history))
logits(m.forward([5]))
try:
    got = logits(m.forward(second))
    fresh = instance()
    want = logits(fresh.forward(history + [5] + second))
    out["second_turn_max_dlogit"] = float(np.abs(got - want).max())
except Exception as exc:
    out["second_turn_max_dlogit"] = "error: " + str(exc)
print(json.dumps(out))
sys.stdout.flush()
os._exit(0)
"""


def run_once(export_dir: Path, settings: dict, prompt: int, decode: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(export_dir / "config.json"), json.dumps(settings),
                           str(prompt), str(decode)], capture_output=True, text=True, timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
        return {"second_turn_max_dlogit": f"error: child exit {proc.returncode}: {tail}"}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("exports", nargs="+", metavar="NAME=EXPORT_DIR")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--decode", type=int, default=32)
    args = parser.parse_args(argv)
    exports = dict(item.split("=", 1) for item in args.exports)
    runs: dict[str, list[dict]] = {name: [] for name in exports}
    for _ in range(args.reps):  # interleaved: drift on a shared machine hits every export alike
        for name, folder in exports.items():
            runs[name].append(run_once(Path(folder), {"thread_num": args.threads}, args.prompt, args.decode))
    # correctness on the exact kernels (the shipped fast profile quantizes activations per call,
    # so a split prefill moves its rounding)
    exact = {name: run_once(Path(folder), {"thread_num": args.threads, "memory": "normal"}, args.prompt, 1)
             for name, folder in exports.items()}
    keys = ("load_s", "prefill_tok_s", "decode_tok_s", "rss_load_gib", "rss_decode_gib")
    table = {}
    for name, results in runs.items():
        row = {key: statistics.median(r[key] for r in results if key in r) if any(key in r for r in results)
               else None for key in keys}
        row["second_turn_max_dlogit"] = exact[name].get("second_turn_max_dlogit")
        table[name] = row
    base = next(iter(table.values()))
    print(f"{'export':<16}" + "".join(f"{k:>18}" for k in keys) + "  second turn")
    for name, row in table.items():
        cells = []
        for key in keys:
            value, ref = row[key], base[key]
            ratio = f" x{value / ref:.2f}" if value is not None and ref else ""
            cells.append(f"{'-' if value is None else f'{value:.3g}'}{ratio}".rjust(18))
        print(f"{name:<16}" + "".join(cells) + f"  {row['second_turn_max_dlogit']}")
    print(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
