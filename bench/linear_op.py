"""MNN's CPU linear (1x1 ``Convolution``, as the export writes one) alone against fp64, next to torch fp32.

    python bench/linear_op.py [--rows 64 512 2048] [--in 1536] [--out 2048] [--threads 1 4] [--variants 0 1 ..]

One-op MNN graphs (JSON, converted by MNN's own converter; llmexport.mnn.linear_graph): y = x W^T
for x [rows, in] with RMS-normed rows, W random with values exactly representable in fp16, stored
as fp32 inline weights of the Convolution, as the export's fp16 record (``quanParameter.type 3``)
or its 8-/4-bit records (block 64, asymmetric), as a Convolution at stride 2 (same output; MNN's
tiled GEMM instead of its Strassen 1x1 executor), or as a MatMul op with an fp32 constant; run
with ``MNN.nn`` on a runtime built as the LLM engine builds one (``precision``, ``memory``,
``dynamic_option``, thread count: llmexport.mnn.runtime.run_module). Reported: max and rms |error|
/ max |output| against fp64 of the same inputs and of the weights the record decodes to, for MNN
(per thread count) and torch fp32. ``VARIANTS`` lists what is measured.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def matmul_graph(path: Path, weight: np.ndarray) -> None:
    from llmexport.mnn.convert import json_to_mnn
    from llmexport.mnn.linear_graph import one_op_graph

    oc, ic = weight.shape
    const = {"name": "w", "type": "Const", "main_type": "Blob", "outputIndexes": [1],
             "main": {"dims": [oc, ic], "dataType": "DT_FLOAT", "dataFormat": "NCHW",
                      "float32s": weight.reshape(-1).tolist()}, "defaultDimentionFormat": "NHWC"}
    matmul = {"name": "matmul", "type": "MatMul", "main_type": "MatMul", "inputIndexes": [0, 1],
              "outputIndexes": [2], "main": {"transposeA": False, "transposeB": True, "T": "DT_FLOAT"},
              "defaultDimentionFormat": "NHWC"}
    json_to_mnn(one_op_graph([const, matmul], ["x", "w", "y"], ic), path.with_suffix(".json"), path)


def inputs(rows: int, ic: int, oc: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, ic))
    x = (x / np.sqrt((x * x).mean(axis=1, keepdims=True))).astype(np.float32)
    w = (rng.standard_normal((oc, ic)) / np.sqrt(ic)).astype(np.float16).astype(np.float32)
    return x, w


def errors(got: np.ndarray, exact: np.ndarray) -> str:
    top = np.abs(exact).max()
    diff = got.astype(np.float64) - exact
    return f"{np.abs(diff).max() / top:.2g} / {np.sqrt((diff * diff).mean()) / top:.2g}"


NORMAL = {"precision": "normal", "memory": "normal"}
#: label -> (weights: None fp32 inline / 16 / 8 / 4 / "matmul", stride-2 convolution, runtime settings)
VARIANTS: dict[str, tuple[int | str | None, bool, dict]] = {
    "Convolution (fp32 inline)": (None, False, NORMAL),
    "Convolution (fp16 record)": (16, False, NORMAL),
    "Convolution (fp16 record), precision high": (16, False, {"precision": "high", "memory": "normal"}),
    "Convolution (fp16 record), memory low": (16, False, {"precision": "normal", "memory": "low"}),
    "Convolution stride 2 (fp16 record)": (16, True, NORMAL),
    "MatMul (fp32 const)": ("matmul", False, NORMAL),
    "Convolution (8-bit record)": (8, False, NORMAL),
    "Convolution stride 2 (8-bit record)": (8, True, NORMAL),
    "Convolution (8-bit record), memory low": (8, False, {"precision": "normal", "memory": "low"}),
    "Convolution (8-bit record), memory low, dynamic_option 2":
        (8, False, {"precision": "normal", "memory": "low", "dynamic_option": 2}),
    "Convolution (4-bit record)": (4, False, NORMAL),
    "Convolution stride 2 (4-bit record)": (4, True, NORMAL),
    "Convolution (4-bit record), memory low": (4, False, {"precision": "normal", "memory": "low"}),
    "Convolution (4-bit record), memory low, dynamic_option 2":
        (4, False, {"precision": "normal", "memory": "low", "dynamic_option": 2}),
}


def build(path: Path, weights: int | str | None, strided: bool, w: np.ndarray) -> np.ndarray:
    """The graph of one variant; returns the weight the runtime computes with."""
    from llmexport.mnn.linear_graph import linear_model
    from llmexport.quant.scheme import QuantScheme

    if weights == "matmul":
        matmul_graph(path, w)
        return w
    assert not isinstance(weights, str)
    return linear_model(path, w, None if weights is None else QuantScheme(bits=weights, block=64), strided)


def main(argv: list[str] | None = None) -> None:
    from llmexport.mnn.runtime import run_module

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--in", dest="ic", type=int, default=1536)
    parser.add_argument("--out", dest="oc", type=int, default=2048)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--variants", nargs="+", choices=range(len(VARIANTS)), type=int,
                        default=list(range(len(VARIANTS))), help="indexes into VARIANTS (all by default)")
    args = parser.parse_args(argv)
    print(f"in {args.ic}, out {args.oc}; error = max / rms |error| over max |output|, against fp64 "
          "of the weights the record decodes to")
    print("| rows | op (weights), settings | " + " | ".join(f"MNN {t} thr" for t in args.threads)
          + " | torch fp32 |")
    print("| --- | --- | " + " | ".join("---" for _ in args.threads) + " | --- |")
    labels = list(VARIANTS)
    with tempfile.TemporaryDirectory(prefix="llmexport-linear-") as tmp:
        for rows in args.rows:
            x, w = inputs(rows, args.ic, args.oc)
            for index in args.variants:
                label = labels[index]
                weights, strided, settings = VARIANTS[label]
                model = Path(tmp) / f"v{index}_{rows}.mnn"
                used = build(model, weights, strided, w)
                exact = x.astype(np.float64) @ used.astype(np.float64).T
                fp32 = (torch.from_numpy(x) @ torch.from_numpy(used).T).numpy()
                cells = [errors(run_module(model, [{"x": x}], ["y"], thread_num=t, settings=settings)[0]["y"]
                                .reshape(exact.shape), exact) for t in args.threads]
                print(f"| {rows} | {label} | " + " | ".join(cells) + f" | {errors(fp32, exact)} |", flush=True)


if __name__ == "__main__":
    main()
