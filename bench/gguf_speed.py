"""llama.cpp on a GGUF file against MNN on its export: prefill and decode tok/s on this machine.

    python bench/gguf_speed.py MODEL.gguf [--export EXPORT_DIR] [--prompts 64 512] [--threads 2]
                               [--reps 3] [--steps 32] [--json OUT]

One run: the export (``--export``, else the file exported here with llmexport's defaults, which
keep llama.cpp's integers) in MNN 3.6.1's runtime (bench/runtime.py ``runtime_speed``: the
runtime's own prefill and decode counters) and the file in llama.cpp (llama-cpp-python, which
must be importable: it is built from the sdist the tests cache, docs/gguf-import.md). Both get
the same prompt ids (1000, 1001, ...), greedy decoding, the same thread count; each measurement
is a fresh process under SCHED_RR where ``chrt`` may, interleaved over ``--reps`` rounds (the
order reversed every other round); medians. llama.cpp's figures are wall times around
llama-cpp-python's ``eval`` of the prompt (one call, batches of 512) and of each decode step (its
performance counters read 0 through the bindings), so its side carries Python's small per-call
overhead (and an argmax over the vocabulary per step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime import realtime_prefix, runtime_speed  # noqa: E402
from runtime_speed import export_default  # noqa: E402

#: llama.cpp in a fresh process: argv model, threads, prompt length, decode steps
LLAMA_CPP_CHILD = r"""
import json, sys, time
import numpy as np
import llama_cpp
path, threads, prompt, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
start = time.perf_counter()
llm = llama_cpp.Llama(model_path=path, n_ctx=prompt + steps + 16, n_batch=512, n_threads=threads,
                      n_threads_batch=threads, verbose=False)
loaded = time.perf_counter()
llm.eval(list(range(1000, 1000 + prompt)))
prefilled = time.perf_counter()
vocab = llm.n_vocab()
for _ in range(steps):  # the last position's logits, as llama.cpp keeps them (without logits_all)
    last = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(vocab,))
    llm.eval([int(np.argmax(last))])
done = time.perf_counter()
print(json.dumps({"prefill_tok_s": prompt / (prefilled - loaded), "decode_tok_s": steps / (done - prefilled),
                  "decoded": steps, "load_s": loaded - start}))
"""


def llama_cpp_speed(model: Path, threads: int, prompt: int, steps: int, prefix: list[str]) -> dict:
    proc = subprocess.run(prefix + [sys.executable, "-c", LLAMA_CPP_CHILD, str(model), str(threads), str(prompt),
                                    str(steps)], capture_output=True, text=True)
    line = next((text for text in proc.stdout.splitlines() if text.startswith("{")), None)
    return json.loads(line) if line else {"error": (proc.stdout + proc.stderr)[-800:]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--export", type=Path, default=None, help="the MNN export (default: export MODEL here)")
    parser.add_argument("--prompts", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    result: dict = {"model": str(args.model), "date": time.strftime("%Y-%m-%d")}
    export = args.export
    if export is None:
        export = Path(tempfile.mkdtemp(prefix="llmexport-gguf-speed-")) / "mnn"
        result["export_wall_s"] = export_default(args.model, export)
    prefix = realtime_prefix()
    runs: dict[str, list[dict]] = {}
    sides = ["mnn", "llama.cpp"]
    for r in range(args.reps):
        for n in args.prompts:
            for t in args.threads:
                for side in (sides if r % 2 == 0 else sides[::-1]):
                    config = {"max_all_tokens": n + args.steps + 16, "max_new_tokens": args.steps}
                    got = (runtime_speed(export, t, n, args.steps, prefix, config) if side == "mnn"
                           else llama_cpp_speed(args.model, t, n, args.steps, prefix))
                    runs.setdefault(f"{side}|{n}@{t}", []).append(got)
    medians = {}
    for key, results in runs.items():
        good = [x for x in results if "error" not in x]
        medians[key] = ({k: statistics.median(x[k] for x in good) for k in good[0]} if good
                        else {"error": results[0]["error"]})
    result.update(realtime=bool(prefix), median_of=args.reps, decode_steps=args.steps, runs=medians,
                  export=str(export))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(f"{args.model} -> {export}; medians of {args.reps}, {args.steps} decode steps, realtime: {bool(prefix)}")
    print("| threads | prompt | llama.cpp prefill / decode tok/s | MNN prefill / decode tok/s | MNN / llama.cpp |")
    print("| --- | --- | --- | --- | --- |")
    for n in args.prompts:
        for t in args.threads:
            a, b = medians[f"llama.cpp|{n}@{t}"], medians[f"mnn|{n}@{t}"]
            if "error" in a or "error" in b:
                print(f"| {t} | {n} | {a.get('error', '')[-100:]!r} | {b.get('error', '')[-100:]!r} | |")
                continue
            print(f"| {t} | {n} | {a['prefill_tok_s']:.1f} / {a['decode_tok_s']:.2f} | {b['prefill_tok_s']:.1f} / "
                  f"{b['decode_tok_s']:.2f} | x{b['prefill_tok_s'] / a['prefill_tok_s']:.2f}, "
                  f"x{b['decode_tok_s'] / a['decode_tok_s']:.2f} |")


if __name__ == "__main__":
    main()
