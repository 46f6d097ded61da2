"""Which MNN CPU kernel runs the exported linears: two candidate changes, on a whole export.

    python bench/kernel_choice.py EXPORT --candidate strided|dynamic_option [--lengths 64 512 2048]
                                  [--forced 8] [--vocab 262144] [--threads 2] [--reps 5] [--no-speed]
                                  [--no-fidelity]

- ``strided``: a copy of the export whose 1x1 Convolutions (every linear) have stride 2 — the same
  output on their 1x1 plane, but MNN 3.6.1's CPU backend then runs its tiled GEMM instead of the
  Strassen 1x1 executor (source/backend/cpu/compute/ConvolutionFloatFactory.cpp ``_createUnit``:
  the Strassen executor needs stride 1). Fidelity against HF/fp64: bench/long_context.py
  ``--strided-linears``.
- ``dynamic_option``: copies of a quantized export with ``dynamic_option`` 0 and 2 in config.json
  (the low-memory int8 kernels quantize each linear's input per row, or per weight block).
  Fidelity: the logits of each against the same export on MNN's exact kernels (``memory: normal``:
  weights dequantized to float), after a random prompt of each length and ``--forced`` more tokens.

Speed, both variants, interleaved ``--reps`` times, each in a fresh process (bench/runtime.py
``runtime_speed``: the runtime's own prefill and decode counters, 64-token prompt, 128 decode
steps); medians and the ratio candidate / baseline. On a shared machine only the ratio means much.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _linked_copy(export_dir: Path, dst: Path) -> Path:
    """``dst`` with every file of the export linked (the big ones are only read)."""
    dst.mkdir(parents=True)
    for path in export_dir.iterdir():
        if path.is_file():
            (dst / path.name).symlink_to(path.resolve())
    return dst


def strided_copy(export_dir: Path, dst: Path) -> Path:
    """The export with stride 2 on every 1x1 Convolution of llm.mnn (its other files linked)."""
    from llmexport.mnn.config import LLM_MODEL
    from llmexport.mnn.convert import json_to_mnn, mnn_to_json

    _linked_copy(export_dir, dst)
    (dst / LLM_MODEL).unlink()
    graph = mnn_to_json(export_dir / LLM_MODEL, dst / "llm.json")
    count = 0
    for op in graph["oplists"]:
        common = op.get("main", {}).get("common", {}) if op.get("type") == "Convolution" else {}
        if common.get("kernelX") == 1 and common.get("kernelY") == 1:
            common.update(strideX=2, strideY=2)
            count += 1
    json_to_mnn(graph, dst / "llm.json", dst / LLM_MODEL)
    (dst / "llm.json").unlink()
    print(f"{count} linears at stride 2 in {dst}")
    return dst


def config_copy(export_dir: Path, dst: Path, keys: dict) -> Path:
    """The export with ``keys`` set in its config.json."""
    _linked_copy(export_dir, dst)
    config = json.loads((export_dir / "config.json").read_text())
    (dst / "config.json").unlink()
    (dst / "config.json").write_text(json.dumps({**config, **keys}, indent=2))
    return dst


def speed(exports: dict[str, Path], threads: int, reps: int) -> dict[str, dict[str, float]]:
    from runtime import realtime_prefix, runtime_speed

    prefix = realtime_prefix()
    runs: dict[str, list[dict]] = {name: [] for name in exports}
    for r in range(reps):  # interleaved, the order swapped every round
        for name in (list(exports) if r % 2 == 0 else list(exports)[::-1]):
            runs[name].append(runtime_speed(exports[name], threads, prefix=prefix))
    out = {}
    for name, results in runs.items():
        good = [x for x in results if "error" not in x]
        if not good:
            raise SystemExit(f"{name}: {results[0]['error']}")
        out[name] = {k: statistics.median(x[k] for x in good) for k in ("prefill_tok_s", "decode_tok_s")}
    return out


def fidelity(exports: dict[str, Path], vocab: int, lengths: list[int], forced: int, threads: int) -> list[str]:
    """Each variant's logits against the first export run on the exact kernels (memory normal)."""
    from llmexport.mnn.config import EXACT_KERNELS
    from llmexport.mnn.runtime import run_runtime

    from long_context import mnn_logits, random_ids

    first = next(iter(exports.values()))
    rows = ["| prompt tokens | " + " | ".join(f"{n}: max / mean abs dlogit vs exact kernels, top-1" for n in exports)
            + " |", "| --- |" + " --- |" * len(exports)]
    for length in lengths:
        ids = random_ids(vocab, length + forced, seed=length)
        prompt, rest = ids[:length], ids[length:]
        exact = run_runtime(first, prompt, rest, 0, config={**EXACT_KERNELS, "thread_num": threads},
                            timeout=7200).forced_logits
        cells = []
        for path in exports.values():
            got = mnn_logits(path, ids, forced + 1, threads)
            diff = np.abs(got - exact)
            top1 = float(np.mean(got.argmax(-1) == exact.argmax(-1)))
            cells.append(f"{diff.max():.4f} / {diff.mean():.5f}, {top1:.2f}")
        rows.append(f"| {length} | " + " | ".join(cells) + " |")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("--candidate", choices=["strided", "dynamic_option"], required=True)
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--forced", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=262144, help="the checkpoint's vocabulary (prompt ids below it)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-speed", action="store_true")
    parser.add_argument("--no-fidelity", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="llmexport-kernel-") as tmp:
        if args.candidate == "strided":
            exports = {"stride 1": args.export, "stride 2": strided_copy(args.export, Path(tmp) / "strided")}
        else:
            exports = {f"dynamic_option {v}": config_copy(args.export, Path(tmp) / f"d{v}", {"dynamic_option": v})
                       for v in (0, 2)}
        if args.candidate == "dynamic_option" and not args.no_fidelity:
            print("\n".join(fidelity(exports, args.vocab, args.lengths, args.forced, args.threads)))
        if not args.no_speed:
            result = speed(exports, args.threads, args.reps)
            (base, a), (cand, b) = result.items()
            print(f"speed, {args.threads} threads, medians of {args.reps} interleaved runs (64-token prompt, "
                  "128 decode steps):")
            for name, r in result.items():
                print(f"  {name}: prefill {r['prefill_tok_s']:.1f} tok/s, decode {r['decode_tok_s']:.2f} tok/s")
            print(f"  {cand} / {base}: prefill x{b['prefill_tok_s'] / a['prefill_tok_s']:.3f}, "
                  f"decode x{b['decode_tok_s'] / a['decode_tok_s']:.3f}")
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
