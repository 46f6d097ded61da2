"""A graph of one exported linear, to measure MNN's kernels on it alone.

``y = x W^T`` for ``x [rows, in]`` (graph input ``x``, output ``y``), written as the rebuild writes
every linear (mnn/rebuild.py: a 1x1 ``Convolution`` between reshapes and layout conversions) with
the weight as a record of ``llm.mnn.weight`` (mnn/weights.py) in ``<model>.weight``, or inline in
fp32. ``strided`` sets stride 2 on the 1x1 plane: the same output, but MNN 3.6.1's CPU backend
then runs its tiled GEMM instead of the Strassen 1x1 executor (docs/benchmarks.md, "Long prompts").
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmexport.mnn.convert import json_to_mnn
from llmexport.mnn.rebuild import _conv_ops
from llmexport.mnn.weight_reader import read_linear
from llmexport.mnn.weights import LinearRecord, WeightFileWriter
from llmexport.quant.scheme import QuantScheme


def one_op_graph(ops: list[dict[str, Any]], tensors: list[str], in_features: int) -> dict[str, Any]:
    """The JSON graph of ``ops`` after an input ``x [-1, in_features]`` (tensor 0), output ``y``."""
    source = {"name": "x", "type": "Input", "main_type": "Input", "outputIndexes": [0],
              "main": {"dims": [-1, in_features], "dtype": "DT_FLOAT", "dformat": "NCHW"},
              "defaultDimentionFormat": "NHWC"}
    return {"oplists": [source] + ops, "tensorName": tensors, "tensorNumber": len(tensors), "outputName": ["y"],
            "sourceType": "ONNX", "preferForwardType": "CPU", "usage": "INFERENCE"}


def linear_model(path: Path, weight: np.ndarray, scheme: QuantScheme | None, strided: bool = False) -> np.ndarray:
    """Write ``path`` (and ``path.weight`` for a record): ``weight [out, in]`` stored under ``scheme``
    (None: fp32 inline). Returns the fp32 weight the runtime computes with (the record decoded)."""
    oc, ic = weight.shape
    tensors = ["x", "y"]
    buffer = io.BytesIO()
    if scheme is not None:
        record = WeightFileWriter(buffer, offset=0).write_linear(torch.from_numpy(weight), None, scheme)
        path.with_name(path.name + ".weight").write_bytes(buffer.getvalue())
    else:
        record = LinearRecord(0, 0, 0, 0, 0, oc, ic, 32, 0, True)
    ops = _conv_ops(tensors, {"inputIndexes": [0], "outputIndexes": [1]}, "linear", record, rank=2)
    conv = next(op for op in ops if op["type"] == "Convolution")
    if strided:
        conv["main"]["common"].update(strideX=2, strideY=2)
    if scheme is None:
        del conv["main"]["quanParameter"], conv["main"]["external"]
        conv["main"].update(weight=weight.reshape(-1).tolist(), bias=[0.0] * oc)
    json_to_mnn(one_op_graph(ops, tensors, ic), path.with_suffix(".json"), path)
    if scheme is None:
        return weight
    return read_linear(buffer.getvalue(), record.external(), record.quan_parameter(), oc, ic)[0].numpy()
