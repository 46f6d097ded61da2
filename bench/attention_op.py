"""MNN's CPU ``Attention`` op alone against fp64, next to torch's fp32 attention.

    python bench/attention_op.py [--tokens 64 512 2048] [--heads 8] [--kv-heads 1] [--head-dim 256]
                                 [--window 512] [--score-std 8] [--threads 4]

A one-op MNN graph (written as JSON, converted by MNN's own converter, run with ``MNN.nn`` at
precision normal, i.e. fp32): inputs q [1, seq, heads, d], k and v [1, seq, kv_heads, d] and an
additive float mask [1, 1, seq, seq] (causal, optionally sliding), output [1, seq, heads * d].
Without the LLM engine the op scales scores by 1/sqrt(d) (CPUAttention.cpp, ``mMeta->attn_scale``
otherwise): every implementation here computes softmax(q k^T / sqrt(d) + mask) v. q and k are
random with the score spread ``--score-std`` (Gemma4's RMS-normed q/k at scale 1.0 give scores of
std ~sqrt(d); a typical LLM at 1/sqrt(d) gives ~1-3). Reported, as fractions of max |output|, for MNN and for
torch fp32 against the fp64 result of the same (fp32) inputs, per length: the largest error and
its bias (``bias``: the error's mean over positions).

Nothing here depends on llmexport but the converter call.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QUERY_CHUNK = 1024


def _input(name: str, index: int, dims: list[int]) -> dict:
    return {"name": name, "type": "Input", "main_type": "Input", "outputIndexes": [index],
            "main": {"dims": dims, "dtype": "DT_FLOAT", "dformat": "NCHW"}, "defaultDimentionFormat": "NHWC"}


def attention_graph(path: Path, heads: int, kv_heads: int, head_dim: int) -> None:
    """Write the one-op graph to ``path`` (MNN's JSON form, converted with ``-f JSON``)."""
    from llmexport.mnn.convert import json_to_mnn

    ops = [_input("q", 0, [1, -1, heads, head_dim]), _input("k", 1, [1, -1, kv_heads, head_dim]),
           _input("v", 2, [1, -1, kv_heads, head_dim]), _input("mask", 3, [1, 1, -1, -1]),
           {"name": "attention", "type": "Attention", "main_type": "AttentionParam", "inputIndexes": [0, 1, 2, 3],
            "outputIndexes": [4], "main": {"kv_cache": False, "layer_index": 0, "kv_shared_layer_index": -1},
            "defaultDimentionFormat": "NHWC"}]
    graph = {"oplists": ops, "tensorName": ["q", "k", "v", "mask", "out"], "tensorNumber": 5,
             "outputName": ["out"], "sourceType": "ONNX", "preferForwardType": "CPU", "usage": "INFERENCE"}
    json_to_mnn(graph, path.with_suffix(".json"), path)


def causal_mask(seq: int, window: int) -> np.ndarray:
    q, k = np.arange(seq)[:, None], np.arange(seq)[None, :]
    allowed = (k <= q) & ((k > q - window) if window else True)
    return np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32).reshape(1, 1, seq, seq)


def reference(q, k, v, mask, dtype) -> np.ndarray:
    q, k, v, mask = (torch.from_numpy(a).to(dtype) for a in (q, k, v, mask))
    heads, kv_heads, d = q.shape[2], k.shape[2], q.shape[3]
    q = q.transpose(1, 2)
    k = k.transpose(1, 2).repeat_interleave(heads // kv_heads, 1)
    v = v.transpose(1, 2).repeat_interleave(heads // kv_heads, 1)
    parts = []
    for i in range(0, q.shape[2], QUERY_CHUNK):  # a score matrix of 8192 queries is 2 GB in fp32
        scores = q[:, :, i:i + QUERY_CHUNK] @ k.transpose(2, 3) / math.sqrt(d) + mask[..., i:i + QUERY_CHUNK, :]
        parts.append(torch.softmax(scores, dim=-1) @ v)
    return torch.cat(parts, 2).transpose(1, 2).reshape(1, q.shape[2], -1).double().numpy()


def main(argv: list[str] | None = None) -> None:
    from llmexport.mnn.runtime import run_module

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--window", type=int, default=512, help="sliding window (0: full causal)")
    parser.add_argument("--score-std", type=float, default=8.0)
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args(argv)
    d = args.head_dim
    print(f"heads {args.heads}, kv_heads {args.kv_heads}, head_dim {d}, window {args.window or 'none'}, "
          f"score std {args.score_std}; error = max abs error / max abs output, against fp64")
    print("| tokens | MNN: max error | MNN: bias | torch fp32: max error | torch fp32: bias | MNN vs torch fp32 |")
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="llmexport-attention-") as tmp:
        model = Path(tmp) / "attention.mnn"
        attention_graph(model, args.heads, args.kv_heads, d)
        for seq in args.tokens:
            q, k, v = random_inputs(seq, args.heads, args.kv_heads, d, args.score_std)
            mask = causal_mask(seq, args.window)
            got = run_module(model, [{"q": q, "k": k, "v": v, "mask": mask}], ["out"], thread_num=args.threads)[0]
            exact = reference(q, k, v, mask, torch.float64)
            fp32 = reference(q, k, v, mask, torch.float32)
            mnn = got["out"].reshape(exact.shape).astype(np.float64)
            top = np.abs(exact).max()
            print(f"| {seq} | {np.abs(mnn - exact).max() / top:.3g} | {bias(mnn, exact) / top:.3g} | "
                  f"{np.abs(fp32 - exact).max() / top:.3g} | {bias(fp32, exact) / top:.3g} | "
                  f"{np.abs(mnn - fp32).max() / top:.3g} |", flush=True)


def random_inputs(seq: int, heads: int, kv_heads: int, d: int, score_std: float):
    rng = np.random.default_rng(seq)
    std = math.sqrt(score_std)  # q.k / sqrt(d) has std score_std when q and k entries have std sqrt(score_std)
    q = (rng.standard_normal((1, seq, heads, d)) * std).astype(np.float32)
    k = (rng.standard_normal((1, seq, kv_heads, d)) * std).astype(np.float32)
    v = rng.standard_normal((1, seq, kv_heads, d)).astype(np.float32)
    return q, k, v


def bias(got: np.ndarray, exact: np.ndarray) -> float:
    """The systematic part of an error: its mean over positions, largest over channels. Rounding
    that is as often up as down averages out over positions; an error of one sign does not, and
    a later layer attending over many positions sums it."""
    return float(np.abs((got - exact).mean(axis=1)).max())

if __name__ == "__main__":
    main()
