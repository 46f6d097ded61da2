"""Quantization benchmark: RTN vs HQQ speed and error, and the size of real exports.

    python bench/quant.py            # ~100 MB of fp16-equivalent weights
    python bench/quant.py --quick    # a few MB; well under two minutes in all

Part 1 quantizes the same LLM-like matrices (heavy-tailed rows, outlier input channels, one
gaussian) with RTN and HQQ, side by side in one run, at 4 and 8 bits with block 64: CPU
throughput in MB of fp16 weights per second, and the HQQ/RTN reconstruction error ratios.

Part 2 builds the tiny Gemma4 checkpoints, exports each at 16, 8 and 4 bits (block 64) with the
library API, and reports the bytes the export spends per linear parameter beside the bits asked.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from llmexport.quant.hqq import quantize_hqq
from llmexport.quant.rtn import dequantize, quantize_rtn

BLOCK = 64
REPEATS = 3
# (oc, ic, student-t dof or None for gaussian, outlier input channels)
_SHAPES = ((2048, 5632, 3.0, 12), (5632, 2048, 4.0, 8), (2048, 2048, 5.0, 10), (1024, 4096, None, 0),
           (4096, 1024, 3.5, 6), (2048, 8192, 4.5, 16))
_QUICK_SHAPES = ((256, 512, 3.0, 4), (512, 256, 4.0, 3), (384, 1024, 5.0, 6), (512, 512, None, 0),
                 (1024, 384, 3.5, 4))


def realistic_matrices(quick: bool, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """LLM-like fp32 weights: ~100 MB of fp16 in all (a few MB with ``quick``)."""
    shapes = _QUICK_SHAPES if quick else _SHAPES
    repeats = 2 if quick else 1
    out = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for rep in range(repeats):
            for oc, ic, dof, n_out in shapes:
                if dof is None:
                    w = torch.randn(oc, ic) * 0.02
                    name = f"gauss {oc}x{ic}"
                else:
                    w = torch.distributions.StudentT(dof).sample((oc, ic)) * 0.02
                    cols = torch.randperm(ic)[:n_out]
                    w[:, cols] *= 10 + 40 * torch.rand(n_out)
                    name = f"t{dof:g}+{n_out}out {oc}x{ic}"
                out.append((f"{name}#{rep}" if repeats > 1 else name, w))
    return out


def bench_quantizers(mats: list[tuple[str, torch.Tensor]], repeats: int) -> list[dict]:
    """Per bit width: each quantizer's time over all matrices (best of ``repeats`` per matrix), and errors."""
    mb = sum(w.numel() for _, w in mats) * 2 / 1e6
    for bits in (4, 8):  # warm-up: thread pools, allocator, first-call dispatch
        for fn in (quantize_rtn, quantize_hqq):
            fn(mats[0][1], bits, BLOCK)
    rows = []
    for bits in (4, 8):
        timings = {}
        errors = {"rtn": [], "hqq": []}
        for label, fn in (("rtn", quantize_rtn), ("hqq", quantize_hqq)):
            # Per matrix, the fastest of ``repeats`` runs: this machine's scheduler stalls a
            # process for ~0.1 s now and then, which would swamp a few-millisecond RTN call.
            elapsed, results = 0.0, []
            for _, w in mats:
                best = float("inf")
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    qt = fn(w, bits, BLOCK)
                    best = min(best, time.perf_counter() - t0)
                elapsed += best
                results.append(qt)
            timings[label] = elapsed
            for (_, w), qt in zip(mats, results):
                d = dequantize(qt) - w
                errors[label].append((float(d.pow(2).sum()), float(d.abs().sum())))
        fro = [(h[0] / r[0]) ** 0.5 for r, h in zip(errors["rtn"], errors["hqq"])]
        mae = [h[1] / r[1] for r, h in zip(errors["rtn"], errors["hqq"])]
        total = {k: [sum(e[i] for e in v) for i in range(2)] for k, v in errors.items()}
        rows.append(dict(
            bits=bits, mb=mb, rtn_mbs=mb / timings["rtn"], hqq_mbs=mb / timings["hqq"],
            fro=(total["hqq"][0] / total["rtn"][0]) ** 0.5, mae=total["hqq"][1] / total["rtn"][1],
            fro_worst=max(fro), mae_worst=max(mae), per_matrix=list(zip([n for n, _ in mats], fro, mae)),
        ))
    return rows


def _linear_params(ckpt: Path) -> int:
    """Parameters of the checkpoint's linears: every >=2-D tensor but the embedding tables.

    A tied checkpoint has no lm_head tensor; its embedding is then also the lm_head linear the
    exporter writes into llm.mnn.weight, so it counts once.
    """
    from safetensors import safe_open

    shapes = {}
    for file in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                shapes[key] = f.get_slice(key).get_shape()
    tied = not any(k.endswith("lm_head.weight") for k in shapes)
    total = 0
    for key, shape in shapes.items():
        if len(shape) < 2 or "vision" in key or "audio" in key:
            continue
        if "embed_tokens_per_layer" in key:
            continue
        if key.endswith("embed_tokens.weight") and not tied:
            continue
        n = 1
        for d in shape:
            n *= int(d)
        total += n
    return total


def bench_exports(workdir: Path) -> list[dict]:
    import llmexport
    from llmexport.quant.scheme import QuantScheme
    from llmexport.tiny.gemma4 import build_tiny_gemma4

    rows = []
    for shape in ("e2b", "26b-a4b"):
        ckpt = build_tiny_gemma4(workdir / shape, shape)
        n_linear = _linear_params(ckpt)
        for bits in (16, 8, 4):
            dst = workdir / f"{shape}-{bits}"
            t0 = time.perf_counter()
            llmexport.export(ckpt, dst, llmexport.ExportOptions(quant=QuantScheme(bits, BLOCK), quiet=True))
            seconds = time.perf_counter() - t0
            weight = (dst / "llm.mnn.weight").stat().st_size
            tables = sum(p.stat().st_size for p in dst.glob("*.bin"))
            rows.append(dict(shape=shape, bits=bits, linear_params=n_linear, weight_bytes=weight,
                             table_bytes=tables, seconds=seconds))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few MB of matrices instead of ~100 MB")
    parser.add_argument("--per-matrix", action="store_true", help="also print each matrix's error ratios")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()

    mats = realistic_matrices(args.quick)
    mb = sum(w.numel() for _, w in mats) * 2 / 1e6
    print(f"Quantizers: {len(mats)} matrices, {mb:.1f} MB as fp16, block {BLOCK}, "
          f"CPU, {torch.get_num_threads()} torch threads, best of {REPEATS} per matrix")
    qrows = bench_quantizers(mats, repeats=REPEATS)
    print(f"{'bits':>4} | {'RTN MB/s':>9} | {'HQQ MB/s':>9} | {'HQQ/RTN fro':>11} | {'HQQ/RTN mae':>11} | "
          f"{'worst fro':>9} | {'worst mae':>9}")
    print("-" * 81)
    for r in qrows:
        print(f"{r['bits']:>4} | {r['rtn_mbs']:>9.1f} | {r['hqq_mbs']:>9.1f} | {r['fro']:>11.3f} | "
              f"{r['mae']:>11.3f} | {r['fro_worst']:>9.3f} | {r['mae_worst']:>9.3f}")
    if args.per_matrix:
        for r in qrows:
            for name, fro, mae in r["per_matrix"]:
                print(f"  {r['bits']}-bit {name:<28} fro {fro:.3f}  mae {mae:.3f}")

    print()
    with tempfile.TemporaryDirectory(prefix="llmexport-bench-") as tmp:
        erows = bench_exports(Path(tmp))
    print("Exports (tiny Gemma4, RTN, block 64): bytes per linear parameter")
    print("  weight = llm.mnn.weight; tables = embedding/PLE files (*.bin, 16-bit);\n"
          "  all = (weight + tables) / linear params")
    print(f"{'shape':>8} | {'bits':>4} | {'linear params':>13} | {'weight B':>9} | {'tables B':>8} | "
          f"{'weight B/p':>10} | {'(bits/p)':>8} | {'all B/p':>7} | {'export s':>8}")
    print("-" * 101)
    for r in erows:
        per = r["weight_bytes"] / r["linear_params"]
        allp = (r["weight_bytes"] + r["table_bytes"]) / r["linear_params"]
        print(f"{r['shape']:>8} | {r['bits']:>4} | {r['linear_params']:>13,} | {r['weight_bytes']:>9,} | "
              f"{r['table_bytes']:>8,} | {per:>10.3f} | {per * 8:>8.2f} | {allp:>7.3f} | "
              f"{r['seconds']:>8.2f}")
    print(f"\ntotal {time.perf_counter() - start:.1f} s")
    if args.json:
        args.json.write_text(json.dumps(dict(quantizers=qrows, exports=erows), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
