"""Prefill and decode speed against prompt length: hybrid recurrent models beside a dense twin.

    python bench/prompt_scaling.py NAME=EXPORT [NAME=EXPORT ...] [--lengths 64 1024 4096] [--threads 2]
                                   [--reps 3] [--steps 32] [--json OUT]

Each export runs in MNN's runtime in a fresh process per measurement (bench/runtime.py's
``runtime_speed``: the runtime's own counters, greedy sampling, under SCHED_RR where ``chrt`` may):
a prompt of ``L`` ordinary token ids, then ``--steps`` decode steps. Lengths and exports are
interleaved ``--reps`` times and medians reported, so a busy moment hits every export alike.

Printed per export and length: prefill tok/s, decode tok/s after that prompt, and the prefill cost
per token relative to the shortest prompt. Attention's cost per prompt token grows with the prompt
(each token attends to all before it); a Gated DeltaNet or short-conv layer's does not (a fixed-size
state), so the hybrid models' per-token cost should grow less than their dense twins' (Qwen3.5:
one layer in four is attention; LFM2: six in sixteen).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime import realtime_prefix, runtime_speed  # noqa: E402


def measure(exports: dict[str, Path], lengths: list[int], threads: int, reps: int, steps: int) -> dict:
    prefix = realtime_prefix()
    runs: dict[str, dict[int, list[dict]]] = {name: {n: [] for n in lengths} for name in exports}
    for rep in range(reps):
        for n in lengths:
            for name, path in exports.items():
                result = runtime_speed(path, threads, prompt=n, steps=steps, prefix=prefix)
                runs[name][n].append(result)
                print(f"rep {rep} {name} L={n}: {result}", file=sys.stderr, flush=True)
    table: dict[str, dict[int, dict]] = {}
    for name, by_length in runs.items():
        table[name] = {}
        for n, results in by_length.items():
            good = [r for r in results if "error" not in r]
            table[name][n] = ({k: statistics.median(r[k] for r in good) for k in ("prefill_tok_s", "decode_tok_s")}
                              if good else {"error": results[0]["error"]})
    return {"threads": threads, "median_of": reps, "decode_steps": steps, "realtime": bool(prefix), "table": table}


def markdown(result: dict) -> str:
    lines = ["| export | prompt | prefill tok/s | decode tok/s | prefill cost per token vs the shortest prompt |",
             "| --- | --- | --- | --- | --- |"]
    for name, by_length in result["table"].items():
        first = None
        for n, row in by_length.items():
            if "error" in row:
                lines.append(f"| {name} | {n} | error | error | |")
                continue
            first = first or row["prefill_tok_s"]
            lines.append(f"| {name} | {n} | {row['prefill_tok_s']:.1f} | {row['decode_tok_s']:.1f} | "
                         f"x{first / row['prefill_tok_s']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("exports", nargs="+", help="NAME=EXPORT_FOLDER")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 1024, 4096])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    exports = {}
    for item in args.exports:
        name, _, path = item.partition("=")
        if not path or not (Path(path) / "config.json").is_file():
            raise SystemExit(f"{item}: expected NAME=EXPORT_FOLDER with a config.json")
        exports[name] = Path(path)
    result = measure(exports, args.lengths, args.threads, args.reps, args.steps)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(markdown(result))


if __name__ == "__main__":
    main()
