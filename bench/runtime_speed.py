"""Prefill and decode speed of an export in MNN's runtime, each figure beside this machine's floor.

    python bench/runtime_speed.py CHECKPOINT [--ours EXPORT_DIR] [--compare NAME=EXPORT_DIR ...]
                                  [--variant NAME=JSON ...] [--prompts 64 512 2048] [--threads 1 2]
                                  [--reps 3] [--steps 32] [--json OUT] [--no-floors] [--variant-fidelity]

One run, on one checkpoint: ours (``--ours``, else the checkpoint exported here with llmexport's
defaults), each ``--compare`` export (e.g. MNN's own exporter's output of the same checkpoint) and
each ``--variant`` (a linked copy of ours with these keys set in config.json, e.g.
``chunk128='{"chunk": 128}'``: runtime options, the export unchanged). Every runtime measurement
runs in a fresh process under SCHED_RR where ``chrt`` may (bench/runtime.py ``runtime_speed``: the
runtime's own prefill and decode counters), interleaved over ``--reps`` rounds; medians.

Floors, measured here in the same run (also under SCHED_RR):
- decode: bytes read per token / memory read bandwidth at that thread count. Bytes per token: the
  whole ``llm.mnn.weight`` (every linear record; with tied embeddings the table is in it and the
  lm_head reads all of it per token), one row of each table read from its own file
  (``embeddings_bf16.bin``, the PLE file: file size / vocabulary), and the KV cache at the prompt's
  length (fp32, as MNN's CPU attention keeps it at ``precision: normal`` with its default
  ``attention_mode`` 8: K and V of every layer that has its own cache; a sliding layer holds at most
  its window; recurrent and conv states are not counted). Bandwidth: numpy ``max`` over a 1 GiB
  float32 buffer split among that many threads (numpy releases the GIL in reductions), best of 5.
- prefill: the time MNN 3.6.1's own kernels take for the model's linears alone: every 2-D tensor of
  the checkpoint outside the embedding tables as one linear over the prompt's rows (the lm_head over
  one row), each distinct shape timed once as a one-op graph (llmexport.mnn.linear_graph, the
  export's record at its bits and block) and summed. Two kernels: ``memory: low`` (the int8
  low-memory kernels the export's config selects: 8-bit activations, 4/8-bit weights) and
  ``memory: normal`` (weights dequantized at load, fp32 GEMM). Attention, norms, RoPE and the
  runtime's own work are left out, so the floor is a lower bound.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime import realtime_prefix, runtime_speed  # noqa: E402

KV_BYTES = 4  # fp32 KV cache (MNN CPU, precision normal, attention_mode 8)
GIB = 2**30


# ---- floors: what the model reads and computes ---------------------------------------------------

def checkpoint_linears(checkpoint: Path) -> tuple[Counter, tuple[int, int]]:
    """{(in, out): count} of the checkpoint's 2-D tensors outside its embedding tables, and the
    lm_head's (in, out) (the token table when tied)."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(file), framework="np") as handle:
            for name in handle.keys():
                shapes[name] = handle.get_slice(name).get_shape()
    head = next((s for n, s in shapes.items() if n.endswith("lm_head.weight")),
                next(s for n, s in shapes.items() if n.endswith("embed_tokens.weight")))
    linears = Counter((s[1], s[0]) for n, s in shapes.items()
                      if len(s) == 2 and "embed" not in n and not n.endswith("lm_head.weight"))
    return linears, (head[1], head[0])


def kv_bytes(checkpoint: Path, length: int) -> int:
    """Bytes of K and V cached for ``length`` tokens (see the module docstring), from config.json read
    as written (transformers' Gemma4 config refuses global reads of its per-layer attributes)."""
    config = json.loads((checkpoint / "config.json").read_text())
    text = config.get("text_config", config)
    layers = text["num_hidden_layers"]
    types = list(text.get("layer_types") or ["full_attention"] * layers)
    own = types[:layers - (text.get("num_kv_shared_layers") or 0)]
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    total = 0
    for kind in own:
        if kind == "full_attention":
            dim = text.get("global_head_dim") or head_dim
            heads = text.get("num_global_key_value_heads") or text["num_key_value_heads"]
            total += 2 * heads * dim * length * KV_BYTES
        elif kind == "sliding_attention":
            total += 2 * text["num_key_value_heads"] * head_dim * min(length, text["sliding_window"]) * KV_BYTES
    return total


def weight_bytes_per_token(export: Path) -> int:
    """llm.mnn.weight whole, plus one row of each table the runtime reads from its own file."""
    config = json.loads((export / "llm_config.json").read_text())
    vocab = json.loads((export / "manifest.json").read_text())["architecture"]["vocab_size"]
    total = (export / "llm.mnn.weight").stat().st_size
    tables = [config.get("ple_embed_file")]
    if "tie_embeddings" not in config:  # tied: the lookup reads the lm_head's table in llm.mnn.weight
        tables.append(config.get("embedding_file", "embeddings_bf16.bin"))
    for name in tables:
        if name and (export / name).exists():
            total += (export / name).stat().st_size // vocab
    return total


BANDWIDTH_CHILD = r"""
import sys, threading, time
import numpy as np
threads = int(sys.argv[1])
buf = np.ones(2**28, dtype=np.float32)  # 1 GiB
parts = np.array_split(buf, threads)
best = 0.0
for _ in range(5):
    workers = [threading.Thread(target=np.max, args=(p,)) for p in parts]
    start = time.perf_counter()
    for w in workers: w.start()
    for w in workers: w.join()
    best = max(best, buf.nbytes / (time.perf_counter() - start))
print(best)
"""


def read_bandwidth(threads: int, prefix: list[str]) -> float:
    """Bytes/s read by ``threads`` threads (a fresh process, ``prefix`` = the realtime scheduler)."""
    proc = subprocess.run(prefix + [sys.executable, "-c", BANDWIDTH_CHILD, str(threads)], capture_output=True,
                          text=True, check=True)
    return float(proc.stdout.split()[-1])


def linear_times(shapes: list[tuple[int, int]], rows: list[int], threads: list[int], bits: int, block: int,
                 reps: int) -> dict[str, float]:
    """Median seconds of one linear: key ``"in,out,rows,threads,memory"`` (runs in this process)."""
    import numpy as np
    from linear_op import inputs
    from linear_speed import _load, _timed

    from llmexport.mnn.linear_graph import linear_model
    from llmexport.quant.scheme import QuantScheme

    out = {}
    with tempfile.TemporaryDirectory(prefix="llmexport-speed-floor-") as tmp:
        for ic, oc in shapes:
            _, w = inputs(1, ic, oc)
            model = Path(tmp) / f"l{ic}x{oc}.mnn"
            linear_model(model, w, QuantScheme(bits=bits, block=block))
            for memory in ("low", "normal"):
                for t in threads:
                    module = _load(model, memory, t, 0)
                    for n in sorted({1, *rows}):
                        x, _ = inputs(n, ic, oc)
                        _timed(module, x)  # the first call resizes and packs
                        out[f"{ic},{oc},{n},{t},{memory}"] = float(np.median([_timed(module, x)
                                                                            for _ in range(reps)]))
                    del module
    return out


def floors(checkpoint: Path, export: Path, prompts: list[int], threads: list[int], reps: int) -> dict:
    """Decode and prefill floors (tokens/s) per thread count and prompt length."""
    prefix = realtime_prefix()
    quant = json.loads((export / "manifest.json").read_text())["options"]["quant"]
    linears, head = checkpoint_linears(checkpoint)
    spec = {"shapes": sorted({*linears, head}), "rows": prompts, "threads": threads, "bits": quant["bits"],
            "block": quant["block"], "reps": reps}
    proc = subprocess.run(prefix + [sys.executable, __file__, "--_linear-times", json.dumps(spec)],
                          capture_output=True, text=True)
    line = next((text for text in proc.stdout.splitlines() if text.startswith("{")), None)
    if line is None:
        raise SystemExit(f"linear timing failed:\n{(proc.stdout + proc.stderr)[-2000:]}")
    times = json.loads(line)
    per_token = weight_bytes_per_token(export)
    out: dict = {"weight_bytes_per_token": per_token, "linears": {f"{i}x{o}": c for (i, o), c in linears.items()},
                 "lm_head": list(head), "quant": quant, "bandwidth_gb_s": {}, "by": {}, "linear_s": times}
    for t in threads:
        bandwidth = read_bandwidth(t, prefix)
        out["bandwidth_gb_s"][t] = bandwidth / 1e9
        for n in prompts:
            cell = {"kv_bytes": kv_bytes(checkpoint, n)}
            cell["decode_tok_s"] = bandwidth / (per_token + cell["kv_bytes"])
            cell["decode_gemv_tok_s"] = 1 / (times[f"{head[0]},{head[1]},1,{t},low"] + sum(
                count * times[f"{i},{o},1,{t},low"] for (i, o), count in linears.items()))
            for memory in ("low", "normal"):
                seconds = times[f"{head[0]},{head[1]},1,{t},{memory}"] + sum(
                    count * times[f"{i},{o},{n},{t},{memory}"] for (i, o), count in linears.items())
                cell[f"prefill_tok_s_{memory}"] = n / seconds
            out["by"][f"{n}@{t}"] = cell
    return out


# ---- measured speed --------------------------------------------------------------------------------

def export_default(checkpoint: Path, out: Path) -> float:
    """llmexport with its defaults; returns the wall time."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", "from llmexport.cli import main; main()", "--path", str(checkpoint),
                           "--dst_path", str(out), "--quiet"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"export failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def speeds(exports: dict[str, Path], prompts: list[int], threads: list[int], reps: int, steps: int) -> dict:
    prefix = realtime_prefix()
    runs: dict[str, list[dict]] = {}
    for r in range(reps):  # interleaved, the export order reversed every other round
        for n in prompts:
            for name in (list(exports) if r % 2 == 0 else list(exports)[::-1]):
                for t in threads:
                    config = {"max_all_tokens": n + steps + 16, "max_new_tokens": steps}
                    runs.setdefault(f"{name}|{n}@{t}", []).append(
                        runtime_speed(exports[name], t, n, steps, prefix, config))
    out = {}
    for key, results in runs.items():
        good = [x for x in results if "error" not in x]
        out[key] = ({k: statistics.median(x[k] for x in good) for k in good[0]} if good
                    else {"error": results[0]["error"]})
    return {"realtime": bool(prefix), "median_of": reps, "decode_steps": steps, "runs": out}


def table(result: dict) -> list[str]:
    """The markdown table: every export's figures beside the floors, and ratios to ours."""
    runs, fl = result["speed"]["runs"], result.get("floors", {}).get("by", {})
    names = list(result["exports"])
    head = ("| threads | prompt | export | prefill tok/s | floor int8 / fp32 kernels | of floor | decode tok/s | "
            "floor: bandwidth / int8 GEMV | of floor | vs ours: prefill, decode |")
    rows = [head, "|" + " --- |" * (head.count("|") - 1)]
    for key in sorted({k.split("|")[1] for k in runs}, key=lambda k: (int(k.split("@")[1]), int(k.split("@")[0]))):
        n, t = key.split("@")
        floor = fl.get(key, {})
        ours = runs.get(f"ours|{key}", {})
        for name in names:
            r = runs[f"{name}|{key}"]
            if "error" in r:
                rows.append(f"| {t} | {n} | {name} | error: {r['error'][-120:]!r} | | | | | | |")
                continue
            pf, df = floor.get("prefill_tok_s_low"), floor.get("decode_tok_s")
            versus = (f"x{r['prefill_tok_s'] / ours['prefill_tok_s']:.2f}, "
                      f"x{r['decode_tok_s'] / ours['decode_tok_s']:.2f}" if name != "ours" and "error" not in ours
                      and ours else "")
            rows.append(f"| {t} | {n} | {name} | {r['prefill_tok_s']:.1f} | "
                        + (f"{pf:.0f} / {floor['prefill_tok_s_normal']:.0f} | {r['prefill_tok_s'] / pf:.2f} | "
                           if pf else "| | ")
                        + f"{r['decode_tok_s']:.2f} | "
                        + (f"{df:.1f} / {floor.get('decode_gemv_tok_s', float('nan')):.1f} | "
                           f"{r['decode_tok_s'] / df:.2f} | " if df else "| | ")
                        + f"{versus} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--_linear-times":  # the floor's timing child
        import os

        spec = json.loads(sys.argv[2])
        print(json.dumps(linear_times([tuple(s) for s in spec["shapes"]], spec["rows"], spec["threads"],
                                      spec["bits"], spec["block"], spec["reps"])), flush=True)
        os._exit(0)  # MNN can crash at interpreter exit
    from kernel_choice import config_copy, fidelity

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--ours", type=Path, default=None, help="our export (default: export CHECKPOINT here)")
    parser.add_argument("--compare", action="append", default=[], metavar="NAME=EXPORT_DIR")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                        help="ours with these keys set in config.json")
    parser.add_argument("--prompts", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32, help="decode steps after each prompt")
    parser.add_argument("--floor-reps", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--no-floors", action="store_true")
    parser.add_argument("--no-speed", action="store_true", help="only the floors (printed as JSON)")
    parser.add_argument("--variant-fidelity", action="store_true",
                        help="each variant's logits against ours on MNN's exact kernels (kernel_choice.fidelity)")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="llmexport-speed-"))
    result: dict = {"checkpoint": str(args.checkpoint), "date": time.strftime("%Y-%m-%d")}
    ours = args.ours
    if ours is None:
        ours = work / "ours"
        result["export_wall_s"] = export_default(args.checkpoint, ours)
    variants = {}
    for item in args.variant:
        name, _, keys = item.partition("=")
        variants[name] = config_copy(ours, work / name, json.loads(keys))
    exports = {"ours": ours, **{n: Path(p) for n, _, p in (c.partition("=") for c in args.compare)}, **variants}
    result["exports"] = {k: str(v) for k, v in exports.items()}
    if not args.no_floors:
        result["floors"] = floors(args.checkpoint, ours, args.prompts, args.threads, args.floor_reps)
    if args.no_speed:
        print(json.dumps(result.get("floors", {}).get("by"), indent=1))
        return
    result["speed"] = speeds(exports, args.prompts, args.threads, args.reps, args.steps)
    if args.variant_fidelity and args.variant:
        vocab = json.loads((ours / "manifest.json").read_text())["architecture"]["vocab_size"]
        result["variant_fidelity"] = fidelity({"ours": ours, **variants}, vocab, args.prompts, 8, max(args.threads))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    fl = result.get("floors")
    print(f"checkpoint {args.checkpoint}, exports {json.dumps(result['exports'])}")
    if fl:
        print(f"bytes read per token (weights, table rows): {fl['weight_bytes_per_token'] / 1e6:.1f} MB; read "
              f"bandwidth GB/s: {json.dumps({t: round(b, 1) for t, b in fl['bandwidth_gb_s'].items()})}; linears "
              f"{json.dumps(fl['linears'])}, lm_head {fl['lm_head']}, {fl['quant']}")
    print(f"medians of {args.reps}, {args.steps} decode steps, realtime scheduling: {result['speed']['realtime']}")
    print("\n".join(table(result)))
    for line in result.get("variant_fidelity", []):
        print(line)


if __name__ == "__main__":
    main()
