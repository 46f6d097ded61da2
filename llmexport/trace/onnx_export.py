"""Trace a rewritten graph to ONNX.

Two flavours from the same modules:
- ``for_mnn=True``: placeholders become ``LlmExport::*`` custom nodes; no big weights in the file.
- ``for_mnn=False``: reference math with the bound weights as initializers, runnable by
  onnxruntime (used by the parity tests on tiny models).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch
from torch import nn

from llmexport.spec import GraphInputs
from llmexport.trace.ops import custom_ops

log = logging.getLogger(__name__)
OPSET = 15


def export_onnx(graph: nn.Module, inputs: GraphInputs, path: Path, for_mnn: bool = True) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), custom_ops(for_mnn), warnings.catch_warnings():
        # The tracer warns about the tensor-valued logits_index slice and shape arithmetic;
        # both are intended (the runtime varies seq_len and logits_index).
        warnings.simplefilter("ignore")
        torch.onnx.export(
            graph, inputs.args, str(path),
            input_names=inputs.names, output_names=inputs.output_names,
            dynamic_axes=inputs.dynamic_axes, opset_version=OPSET,
            do_constant_folding=True, dynamo=False,
        )
    log.info("traced ONNX graph to %s (%d bytes)", path, path.stat().st_size)
    return path
