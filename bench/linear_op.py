"""MNN's CPU linear (1x1 ``Convolution``, as the export writes one) alone against fp64, next to torch fp32.

    python bench/linear_op.py [--rows 64 512 2048] [--in 1536] [--out 2048] [--threads 1 2 4]

One-op MNN graphs (JSON, converted by MNN's own converter, run with ``MNN.nn`` at precision
normal): y = x W^T for x [rows, in] with RMS-normed rows, W random with values exactly
representable in fp16, stored (a) as fp32 inline weights of the Convolution, (b) as the export's
fp16 record (``quanParameter.type 3``, external ``.weight`` file; llmexport.mnn.weights), and
(c) as a MatMul op with an fp32 constant. Reported: max and rms |error| / max |output| against
fp64 of the same inputs, for MNN (per thread count) and torch fp32.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _input(rows_dims: list[int]) -> dict:
    return {"name": "x", "type": "Input", "main_type": "Input", "outputIndexes": [0],
            "main": {"dims": rows_dims, "dtype": "DT_FLOAT", "dformat": "NCHW"}, "defaultDimentionFormat": "NHWC"}


def _graph(ops: list[dict], tensors: list[str]) -> dict:
    return {"oplists": ops, "tensorName": tensors, "tensorNumber": len(tensors), "outputName": ["y"],
            "sourceType": "ONNX", "preferForwardType": "CPU", "usage": "INFERENCE"}


def conv_graph(path: Path, weight: np.ndarray, fp16_record: bool) -> None:
    """x [rows, in] -> Reshape [-1, in, 1, 1] -> NC4HW4 -> Conv1x1 -> NCHW -> Reshape [-1, out]."""
    from llmexport.mnn.convert import json_to_mnn
    from llmexport.mnn.rebuild import _conv_ops
    from llmexport.mnn.weights import LinearRecord, WeightFileWriter
    from llmexport.quant.scheme import QuantScheme

    oc, ic = weight.shape
    tensors = ["x", "y"]
    if fp16_record:
        buffer = io.BytesIO()
        record = WeightFileWriter(buffer, offset=0).write_linear(torch.from_numpy(weight), None,
                                                                 QuantScheme(bits=16))
        path.with_name(path.name + ".weight").write_bytes(buffer.getvalue())
    else:
        record = LinearRecord(0, 0, 0, 0, 0, oc, ic, 32, 0, True)
    ops = _conv_ops(tensors, {"inputIndexes": [0], "outputIndexes": [1]}, "linear", record, rank=2)
    conv = next(op for op in ops if op["type"] == "Convolution")
    if not fp16_record:
        del conv["main"]["quanParameter"], conv["main"]["external"]
        conv["main"].update(weight=weight.reshape(-1).tolist(), bias=[0.0] * oc)
    json_to_mnn(_graph([_input([-1, ic])] + ops, tensors), path.with_suffix(".json"), path)


def matmul_graph(path: Path, weight: np.ndarray) -> None:
    from llmexport.mnn.convert import json_to_mnn

    oc, ic = weight.shape
    const = {"name": "w", "type": "Const", "main_type": "Blob", "outputIndexes": [1],
             "main": {"dims": [oc, ic], "dataType": "DT_FLOAT", "dataFormat": "NCHW",
                      "float32s": weight.reshape(-1).tolist()}, "defaultDimentionFormat": "NHWC"}
    matmul = {"name": "matmul", "type": "MatMul", "main_type": "MatMul", "inputIndexes": [0, 1],
              "outputIndexes": [2], "main": {"transposeA": False, "transposeB": True, "T": "DT_FLOAT"},
              "defaultDimentionFormat": "NHWC"}
    graph = _graph([_input([-1, ic]), const, matmul], ["x", "w", "y"])
    json_to_mnn(graph, path.with_suffix(".json"), path)


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


def main(argv: list[str] | None = None) -> None:
    from llmexport.mnn.runtime import run_module

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--in", dest="ic", type=int, default=1536)
    parser.add_argument("--out", dest="oc", type=int, default=2048)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args(argv)
    print(f"in {args.ic}, out {args.oc}; error = max / rms |error| over max |output|, against fp64")
    print("| rows | op (weights) | " + " | ".join(f"MNN {t} thr" for t in args.threads) + " | torch fp32 |")
    print("| --- | --- | " + " | ".join("---" for _ in args.threads) + " | --- |")
    with tempfile.TemporaryDirectory(prefix="llmexport-linear-") as tmp:
        for rows in args.rows:
            x, w = inputs(rows, args.ic, args.oc)
            exact = x.astype(np.float64) @ w.astype(np.float64).T
            fp32 = (torch.from_numpy(x) @ torch.from_numpy(w).T).numpy()
            for label, build in (("Convolution (fp32)", lambda p: conv_graph(p, w, False)),
                                 ("Convolution (fp16 record)", lambda p: conv_graph(p, w, True)),
                                 ("MatMul (fp32 const)", lambda p: matmul_graph(p, w))):
                model = Path(tmp) / f"{label.split()[0]}{rows}{len(label)}.mnn"
                build(model)
                cells = [errors(run_module(model, [{"x": x}], ["y"], thread_num=t)[0]["y"].reshape(exact.shape),
                                exact) for t in args.threads]
                print(f"| {rows} | {label} | " + " | ".join(cells) + f" | {errors(fp32, exact)} |", flush=True)


if __name__ == "__main__":
    main()
