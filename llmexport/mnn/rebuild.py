"""Replace the converter's ``Extra`` placeholder ops with MNN's own ops.

After ONNX -> MNN -> JSON, every ``LlmExport::Linear`` node is an ``Extra`` op carrying its
attributes. Each becomes a 1x1 ``Convolution`` whose (quantized) weights live in
``llm.mnn.weight`` (wrapped in the reshapes/layout converts MNN's convolution needs), and each
``LlmExport::Attention`` becomes MNN's KV-cached ``Attention`` op (``LlmExport::LinearAttention`` its
state-carrying ``LinearAttention`` op). Weights are pulled from the
checkpoint one linear at a time, in graph order, so memory stays at one tensor.
"""

from __future__ import annotations

import copy
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterable, Mapping

import torch

from llmexport.errors import ConversionError
from llmexport.mnn.weights import LinearRecord, WeightFileWriter
from llmexport.quant.rtn import NonFiniteError
from llmexport.quant.scheme import QuantMethod, QuantScheme
from llmexport.spec import ExpertTemplate, LinearSpec, Quantizer
from llmexport.trace.ops import expert_subgraph_name

log = logging.getLogger(__name__)

WeightFn = Callable[[str], tuple[torch.Tensor, torch.Tensor | None]]
SchemeFn = Callable[[LinearSpec], QuantScheme]


class NonFiniteLinear(NonFiniteError):
    """A linear's checkpoint values cannot be written (NaN/Inf, beyond the format's range)."""

    def __init__(self, linear: str, reason: str):
        super().__init__(f"linear {linear!r}: {reason}")
        self.linear, self.reason = linear, reason


@dataclass
class RebuildResult:
    graph: dict[str, Any]
    records: dict[str, LinearRecord]
    schemes: dict[str, QuantScheme]


def extra_attrs(op: dict[str, Any]) -> dict[str, Any]:
    """Attributes of a converter ``Extra`` op as a plain dict (ints, floats or strings)."""
    out: dict[str, Any] = {}
    for attr in op["main"].get("attr", []):
        if "s" in attr:
            out[attr["key"]] = attr["s"]
        elif attr.get("f", 0.0) != 0.0:
            out[attr["key"]] = attr["f"]
        else:
            out[attr["key"]] = attr.get("i", 0)
    return out


def _extra_type(op: dict[str, Any]) -> str | None:
    return op["main"].get("type") if op.get("type") == "Extra" else None


def _new_tensor(tensors: list[str], name: str) -> int:
    tensors.append(name)
    return len(tensors) - 1


def _op(name: str, op_type: str, inputs: list[int], outputs: list[int], main_type: str, main: dict) -> dict:
    return {"name": name, "type": op_type, "inputIndexes": inputs, "outputIndexes": outputs,
            "main_type": main_type, "main": main, "defaultDimentionFormat": "NHWC"}


def _conv_ops(tensors: list[str], op: dict[str, Any], name: str, record: LinearRecord, rank: int) -> list[dict]:
    """[.., ic] -> Reshape[-1, ic, 1, 1] -> NC4HW4 -> Conv1x1 -> NCHW -> Reshape[1, -1, oc] (rank 3)
    or [-1, oc] (rank 2, inside expert subgraphs)."""
    t = [_new_tensor(tensors, f"{name}/{suffix}") for suffix in ("pre_reshape", "pre_convert", "conv",
                                                                 "post_convert")]
    oc, ic = record.oc, record.ic
    common = {"dilateX": 1, "dilateY": 1, "strideX": 1, "strideY": 1, "kernelX": 1, "kernelY": 1,
              "padX": 0, "padY": 0, "group": 1, "outputCount": oc, "relu": False, "padMode": "CAFFE",
              "relu6": False, "inputCount": ic, "hasOutputShape": False}
    return [
        _op(f"{name}/pre_reshape", "Reshape", op["inputIndexes"], [t[0]], "Reshape",
            {"dims": [-1, ic, 1, 1], "dimType": "NCHW"}),
        _op(f"{name}/pre_convert", "ConvertTensor", [t[0]], [t[1]], "TensorConvertInfo",
            {"source": "NCHW", "dest": "NC4HW4"}),
        _op(name, "Convolution", [t[1]], [t[2]], "Convolution2D",
            {"common": common, "quanParameter": record.quan_parameter(), "external": record.external()}),
        _op(f"{name}/post_convert", "ConvertTensor", [t[2]], [t[3]], "TensorConvertInfo",
            {"source": "NC4HW4", "dest": "NCHW"}),
        _op(f"{name}/post_reshape", "Reshape", [t[3]], op["outputIndexes"], "Reshape",
            {"dims": [1, -1, oc] if rank == 3 else [-1, oc], "dimType": "NCHW"}),
    ]


def _attention_op(op: dict[str, Any]) -> dict:
    a = extra_attrs(op)
    return _op(a["name"], "Attention", op["inputIndexes"], op["outputIndexes"], "AttentionParam",
               {"kv_cache": True, "layer_index": int(a["layer_index"]),
                "kv_shared_layer_index": int(a["kv_shared_layer_index"]), "attnScale": float(a["scale"])})


def _linear_attention_op(op: dict[str, Any]) -> dict:
    """MNN's LinearAttention op (LinearAttentionParam, schema/default/MNN.fbs): its inputs are the
    placeholder's (qkv, gate, beta, conv weight); the conv and recurrent states live in the op."""
    a = extra_attrs(op)
    return _op(a["name"], "LinearAttention", op["inputIndexes"], op["outputIndexes"], "LinearAttentionParam",
               {"attn_type": a["attn_type"], "num_k_heads": int(a["num_k_heads"]),
                "num_v_heads": int(a["num_v_heads"]), "head_k_dim": int(a["head_k_dim"]),
                "head_v_dim": int(a["head_v_dim"]), "use_qk_l2norm": bool(a["use_qk_l2norm"])})


def _moe_op(op: dict[str, Any]) -> dict:
    """MNN's MoE module reads num_experts, top_k and layer_id from the Extra attributes."""
    moe = dict(op)
    moe["type"] = "MoE"
    moe["main"] = {"attr": [a for a in op["main"]["attr"] if a["key"] in ("num_experts", "top_k", "layer_id")]}
    return moe


class _Prefetcher:
    """Reads the next linear's weights on a worker thread while the current one is quantized
    (file reads and torch kernels both release the GIL)."""

    def __init__(self, order: list[str], weight_fn: WeightFn):
        self.order, self.weight_fn = order, weight_fn
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmexport-read")
        self.pending: dict[str, Future] = {}
        self.position = 0
        self._schedule()

    def _schedule(self) -> None:
        if self.position < len(self.order) and not self.pending:
            name = self.order[self.position]
            self.pending[name] = self.pool.submit(self.weight_fn, name)

    def get(self, name: str):
        future = self.pending.pop(name, None)
        if future is None:  # out of the expected order: read directly
            return self.weight_fn(name)
        self.position += 1
        self._schedule()
        return future.result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _linear_order(ops: list[dict], rename: Callable[[str], str] = str) -> list[str]:
    return [rename(extra_attrs(op)["name"]) for op in ops if _extra_type(op) == "Linear"]


class _Rebuilder:
    def __init__(self, linears: Iterable[LinearSpec], weight_fn: WeightFn, scheme_fn: SchemeFn,
                 weight_file: BinaryIO, quantizers: Mapping[QuantMethod, Quantizer],
                 progress: Callable[[int], None] | None):
        # STORED linears carry their own integers (llmexport.quant.transcode): no quantizer
        self.quantizers = quantizers
        self.specs = {spec.name: spec for spec in linears}
        self.writer = WeightFileWriter(weight_file, offset=0)
        self.weight_fn, self.scheme_fn, self.progress = weight_fn, scheme_fn, progress
        self.records: dict[str, LinearRecord] = {}
        self.schemes: dict[str, QuantScheme] = {}
        self.reader: _Prefetcher | None = None

    def linear(self, name: str) -> LinearRecord:
        spec = self.specs.get(name)
        if spec is None or name in self.records:
            raise ConversionError(f"graph linear {name!r} is unknown or appears twice")
        weight, bias = self.reader.get(name) if self.reader else self.weight_fn(name)
        scheme = self.schemes[name] = self.scheme_fn(spec)
        try:
            self.records[name] = self.writer.write_linear(weight, bias, scheme, self.quantizers.get(scheme.method))
        except NonFiniteError as exc:
            raise NonFiniteLinear(name, str(exc)) from None
        if self.progress:
            self.progress(weight.numel())
        return self.records[name]

    def ops(self, ops: list[dict], tensors: list[str], rank: int, rename: Callable[[str], str] = str) -> list[dict]:
        out: list[dict] = []
        for op in ops:
            kind = _extra_type(op)
            if kind == "Linear":
                name = rename(extra_attrs(op)["name"])
                out += _conv_ops(tensors, op, name, self.linear(name), rank)
            elif kind == "Attention":
                out.append(_attention_op(op))
            elif kind == "MoE":
                out.append(_moe_op(op))
            elif kind == "LinearAttention":
                out.append(_linear_attention_op(op))
            elif kind is not None:
                raise ConversionError(f"unexpected custom op {kind!r} in converted graph")
            else:
                out.append(op)
        return out


def _expert_subgraphs(rb: _Rebuilder, template: dict[str, Any], experts: ExpertTemplate) -> list[dict]:
    """One subgraph per (layer, expert): the converted template with its placeholders renamed."""
    inputs = [op["outputIndexes"][0] for op in template["oplists"] if op["type"] == "Input"]
    outputs = [template["tensorName"].index(name) for name in template["outputName"]]
    subgraphs = []
    for layer_id, expert, replacement in experts.instances:
        tensors = list(template["tensorName"])
        nodes = rb.ops(copy.deepcopy(template["oplists"]), tensors, rank=2,
                       rename=lambda name: name.replace(experts.marker, replacement))
        subgraphs.append({"name": expert_subgraph_name(layer_id, expert), "inputs": inputs, "outputs": outputs,
                          "tensors": tensors, "nodes": nodes})
    return subgraphs


def rebuild_graph(graph: dict[str, Any], linears: Iterable[LinearSpec], weight_fn: WeightFn,
                  scheme_fn: SchemeFn, weight_file: BinaryIO, quantizers: Mapping[QuantMethod, Quantizer],
                  progress: Callable[[int], None] | None = None,
                  experts: Iterable[tuple[dict[str, Any], ExpertTemplate]] = ()) -> RebuildResult:
    """Rewrite ``graph`` in place and stream every linear's weights into ``weight_file``.

    ``quantizers``: the quantizer of each scheme method (llmexport.quant.methods, chosen by the
    pipeline); ``experts``: converted expert template graphs with their instances, which become
    the ``/expert/{layer}_{e}`` subgraphs MNN's MoE op runs.
    """
    experts = list(experts)
    rb = _Rebuilder(linears, weight_fn, scheme_fn, weight_file, quantizers, progress)
    order = _linear_order(graph["oplists"]) + [
        name for template_json, template in experts for _, _, replacement in template.instances
        for name in _linear_order(template_json["oplists"], lambda n: n.replace(template.marker, replacement))]
    rb.reader = _Prefetcher(order, weight_fn)
    try:
        graph["oplists"] = rb.ops(graph["oplists"], graph["tensorName"], rank=3)
        subgraphs = [sub for template_json, template in experts
                     for sub in _expert_subgraphs(rb, template_json, template)]
    finally:
        rb.reader.close()
    if subgraphs:
        graph["subgraphs"] = subgraphs
    missing = set(rb.specs) - set(rb.records)
    if missing:
        raise ConversionError(f"{len(missing)} linear(s) missing from the traced graph, e.g. {sorted(missing)[0]!r}")
    graph["tensorNumber"] = len(graph["tensorName"])
    # The converter stamps a random uuid; a fixed one keeps exports byte-for-byte reproducible.
    graph["mnn_uuid"] = "00000000-0000-0000-0000-000000000000"
    return RebuildResult(graph, rb.records, rb.schemes)
