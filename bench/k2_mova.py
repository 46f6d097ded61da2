"""MoVA benchmark: MNN decode speed with sparse MoVA versus MoVA evaluated densely.

    python bench/k2_mova.py            # 4 sparse layers, 64 value experts (top-4), 3 rounds
    python bench/k2_mova.py --quick    # smaller model, fewer tokens (about a minute)
    python bench/k2_mova.py --tiny     # the test suite's tiny "sparse" variant (8 value experts)

Builds one random K2-Horizon checkpoint (every layer sparse: MoE FFN + MoVA attention; 64 value
experts as the published family has), exports it twice with the library API -- as shipped (MoVA
value experts on MNN's MoE op: only the chosen top-k run) and with ``K2Horizon.dense_mova``
(every value expert runs in the main graph, weighted by a dense routing matrix) -- then, in
alternating rounds, each export in a fresh MNN runtime process: prefill a prompt, time greedy
decode steps. Prints decode tokens/s of both (median of the rounds), their ratio, and whether
the two exports agree (same greedy ids, max logit difference): they compute the same function.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np

PROMPT = list(range(300, 332))


def bench_config(quick: bool, tiny: bool = False) -> dict:
    from llmexport.tiny.k2_horizon import base_config, variant_config

    if tiny:
        return variant_config("sparse")
    config = base_config()
    config.update(hidden_size=256 if quick else 512, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=32 if quick else 64,
                  mlp_only_layers=[], decoder_sparse_step=1, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=256, num_shared_experts=1, mova_num_experts=64, mova_top_k=4)
    return config


def export_pair(checkpoint: Path, work: Path, bits: int) -> dict[str, Path]:
    from llmexport import ExportOptions, export
    from llmexport.models.k2_horizon.family import K2Horizon
    from llmexport.quant.scheme import QuantScheme

    outs = {}
    for name, dense in (("sparse", False), ("dense", True)):
        with mock.patch.object(K2Horizon, "dense_mova", dense):
            start = time.perf_counter()
            export(checkpoint, work / name, ExportOptions(quant=QuantScheme(bits, 64), quiet=True))
            print(f"exported {name} MoVA in {time.perf_counter() - start:.1f}s")
        outs[name] = work / name
    return outs


def run_child(export_dir: Path, tokens: int, threads: int) -> dict:
    request = {"config": str(export_dir / "config.json"), "tokens": tokens, "threads": threads}
    proc = subprocess.run([sys.executable, __file__, "--child"], input=json.dumps(request), capture_output=True,
                          text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"MNN child failed on {export_dir}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def child() -> None:
    """One fresh runtime: prefill, then ``tokens`` timed greedy decode steps (os._exit: MNN 3.6.1
    can crash at interpreter exit)."""
    import MNN.llm as llm

    request = json.loads(sys.stdin.read())
    model = llm.create(request["config"])
    model.set_config({"thread_num": request["threads"]})
    model.load()
    logits = np.array(model.forward(PROMPT).read(), dtype=np.float32).reshape(-1)
    ids, first = [], logits.copy()
    start = time.perf_counter()
    for _ in range(request["tokens"]):
        ids.append(int(np.argmax(logits)))
        logits = np.array(model.forward([ids[-1]]).read(), dtype=np.float32).reshape(-1)
    elapsed = time.perf_counter() - start
    print(json.dumps({"tokens_per_s": request["tokens"] / elapsed, "ids": ids, "first_logits": first.tolist()}))
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny sparse variant (overhead-bound)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=None, help="timed decode steps per round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quant_bit", type=int, default=16, choices=(4, 8, 16))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child()
    from llmexport.tiny.k2_horizon import build_k2_horizon_checkpoint

    tokens = args.tokens or (32 if args.quick else 64)
    config = bench_config(args.quick, args.tiny)
    with tempfile.TemporaryDirectory(prefix="k2-mova-bench-") as tmp:
        work = Path(tmp)
        checkpoint = build_k2_horizon_checkpoint(work / "model", config, seed=0)
        outs = export_pair(checkpoint, work, args.quant_bit)
        speeds: dict[str, list[float]] = {"sparse": [], "dense": []}
        results = {}
        for _ in range(args.rounds):
            for name in ("sparse", "dense"):  # alternating: both see the same machine state
                results[name] = run_child(outs[name], tokens, args.threads)
                speeds[name].append(results[name]["tokens_per_s"])
    sparse, dense = statistics.median(speeds["sparse"]), statistics.median(speeds["dense"])
    diff = float(np.abs(np.array(results["sparse"]["first_logits"]) - np.array(results["dense"]["first_logits"])).max())
    print(f"model: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, MoVA "
          f"{config['mova_num_experts']} value experts top-{config['mova_top_k']} of width "
          f"{config['num_key_value_heads'] * config['head_dim']}, MoE {config['num_experts']} experts "
          f"top-{config['num_experts_per_tok']}; weights {args.quant_bit}-bit; {args.threads} threads; "
          f"{tokens} decode steps x {args.rounds} rounds")
    print(f"sparse MoVA (MoE op, top-{config['mova_top_k']} run): {sparse:8.1f} tokens/s  "
          f"(rounds: {', '.join(f'{s:.1f}' for s in speeds['sparse'])})")
    print(f"dense MoVA  (all {config['mova_num_experts']} run):      {dense:8.1f} tokens/s  "
          f"(rounds: {', '.join(f'{s:.1f}' for s in speeds['dense'])})")
    print(f"sparse / dense = {sparse / dense:.2f}x; same greedy ids: "
          f"{results['sparse']['ids'] == results['dense']['ids']}; max |logit diff| after prefill {diff:.2e}")


if __name__ == "__main__":
    main()
