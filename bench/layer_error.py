"""Where MNN's logits part from HF's: each decoder layer's own error, MNN's and torch's, against fp64.

    python bench/layer_error.py EXPORT CHECKPOINT [--tokens 512]

EXPORT is a 16-bit export of CHECKPOINT (bench/long_context.py --export keeps one). MNN's LLM
engine only returns logits, so the layers are read from a debug copy of ``llm.mnn`` run as a plain
module (MNN.nn, every layer's output requested): Attention without the engine's KV cache (the
CPU op runs the same kernel, CPUAttention.cpp), each KV-shared layer fed its source layer's k/v,
and q multiplied by sqrt(head_dim) * the family's scale, because without the engine's meta the op
scales by 1/sqrt(head_dim) (it never reads the graph's attnScale). The debug copy's logits are
checked against the runtime's for the same prompt.

Layer i's *local* error: its output from MNN against the export's rewrite (the traced graph,
eager, the export's stored weights) fed MNN's own output of layer i-1, computed in fp32 and in
fp64 (HF's fp32 up-casts kept in fp64, the RoPE angles the model's fp32 ones: long_context.py).
Were MNN's local errors of the order of torch fp32's, no MNN op would add error beyond fp32
rounding; a ratio well above 1 on every layer (docs/benchmarks.md, long prompts) says MNN's
kernels round more than torch's throughout, not one layer type.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from long_context import as_fp64, fp64_upcasts, mnn_logits, random_ids, stored_linears  # noqa: E402


def _layer_outputs(graph: dict) -> list[str]:
    """The last tensor each ``/layers.N/`` scope produces (the layer's output), in layer order."""
    last: dict[int, str] = {}
    for op in graph["oplists"]:
        name = op.get("name", "")
        if name.startswith("/layers.") and op.get("outputIndexes"):
            last[int(name.split(".")[1].split("/")[0])] = graph["tensorName"][op["outputIndexes"][0]]
    return [last[i] for i in sorted(last)]


def _scale_q(graph: dict, op: dict, factor: float, ops: list[dict]) -> None:
    names = graph["tensorName"]
    index = op["main"]["layer_index"]
    const, scaled = len(names), len(names) + 1
    names += [f"debug/q_factor{index}", f"debug/q_scaled{index}"]
    ops.append({"name": names[const], "type": "Const", "main_type": "Blob", "outputIndexes": [const],
                "main": {"dataFormat": "NCHW", "dataType": "DT_FLOAT", "float32s": [factor]},
                "defaultDimentionFormat": "NHWC"})
    ops.append({"name": names[scaled], "type": "BinaryOp", "main_type": "BinaryOp",
                "inputIndexes": [op["inputIndexes"][0], const], "outputIndexes": [scaled],
                "main": {"opType": "MUL", "T": "DT_FLOAT", "activationType": 0}, "defaultDimentionFormat": "NHWC"})
    op["inputIndexes"][0] = scaled


def debug_graph(export_dir: Path, out: Path, head_dims: dict[int, int], scale: float) -> list[str]:
    """Write ``out/debug.mnn`` (see the module docstring); returns the layer output names."""
    from llmexport.mnn.convert import json_to_mnn, mnn_to_json

    graph = mnn_to_json(export_dir / "llm.mnn", out / "graph.json")
    sources = {op["main"]["layer_index"]: list(op["inputIndexes"])
               for op in graph["oplists"] if op["type"] == "Attention"}
    ops: list[dict] = []
    for op in graph["oplists"]:
        if op["type"] == "Attention":
            main = op["main"]
            shared = main["kv_shared_layer_index"]
            if shared >= 0:
                op["inputIndexes"][1:3] = sources[shared][1:3]
            main.update(kv_cache=False, kv_shared_layer_index=-1)
            _scale_q(graph, op, math.sqrt(head_dims[main["layer_index"]]) * scale, ops)
        ops.append(op)
    graph["oplists"], graph["tensorNumber"] = ops, len(graph["tensorName"])
    json_to_mnn(graph, out / "debug.json", out / "debug.mnn")
    os.symlink(export_dir / "llm.mnn.weight", out / "debug.mnn.weight")
    return _layer_outputs(graph)


def rewrite(arch, export_dir: Path, dtype: torch.dtype):
    from llmexport.trace.eager import placeholders

    graph = arch.build_graph()
    by_name = {linear.name: linear for linear in placeholders(graph)}
    for name, weight, bias in stored_linears(export_dir):
        if name != "lm_head":  # the layers only
            by_name[name].bind(weight.to(dtype), None if bias is None else bias.to(dtype))
    return as_fp64(graph) if dtype == torch.float64 else graph.to(dtype)


class _Done(Exception):
    pass


def local_outputs(arch, export_dir: Path, args, mnn_layers: list[np.ndarray], dtype: torch.dtype) -> list[torch.Tensor]:
    """Each layer of the rewrite fed MNN's output of the layer before it."""
    graph, outputs = rewrite(arch, export_dir, dtype), []
    for i, layer in enumerate(graph.layers):
        if i:
            layer.register_forward_pre_hook(
                lambda m, a, i=i: (torch.from_numpy(mnn_layers[i - 1]).to(dtype).view_as(a[0]), *a[1:]))

        def keep(m, a, out, i=i, last=len(graph.layers) - 1):
            outputs.append(out.detach().double())
            if i == last:
                raise _Done

        layer.register_forward_hook(keep)
    try:
        with torch.no_grad():
            graph(*[a.to(dtype) if a.is_floating_point() else a for a in args])
    except _Done:
        pass
    del graph
    gc.collect()
    return outputs


def main(argv: list[str] | None = None) -> None:
    from llmexport.mnn.runtime import run_module
    from llmexport.mnn.token_table import token_table
    from llmexport.source.checkpoint import Checkpoint
    from llmexport.source.loading import open_architecture
    from llmexport.trace.eager import prompt_inputs

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args(argv)
    arch = open_architecture(Checkpoint.open(args.checkpoint))
    scale = float(json.loads((args.export / "llm_config.json").read_text()).get("attn_scale", 0) or 0)
    ids = random_ids(arch.args.vocab_size, args.tokens, seed=args.tokens)
    # without a token table (mnn/token_table.py) the runtime reads a tied embedding out of the lm_head record
    embedding = next(w for n, w, _ in stored_linears(args.export) if n == "lm_head") \
        if token_table(arch) is None else arch.embedding_table()
    inputs = prompt_inputs(arch, torch.tensor(ids), embedding, arch.ple_table(), all_logits=False)
    del embedding
    feed = dict(zip(["input_ids", "attention_mask", "position_ids", "logits_index"],
                    (a.numpy() for a in inputs)))
    with tempfile.TemporaryDirectory(prefix="llmexport-layers-") as tmp:
        layers = arch.args.layers
        head_dims = {layer.index: getattr(layer, "head_dim", getattr(arch.args, "head_dim", 0)) for layer in layers}
        names = debug_graph(args.export, Path(tmp), head_dims, scale or 1.0 / math.sqrt(head_dims[0]))
        got = run_module(Path(tmp) / "debug.mnn", [feed], ["logits", *names], thread_num=4, timeout=7200)[0]
    runtime = mnn_logits(args.export, ids, 1, 4)[0]
    print(f"{args.tokens} tokens; debug module vs MNN's runtime, last-position logits: max abs diff "
          f"{np.abs(got['logits'].reshape(-1) - runtime).max():.3g}")
    mnn = [got[name] for name in names]
    fp32 = local_outputs(arch, args.export, inputs, mnn, torch.float32)
    with fp64_upcasts():
        fp64 = local_outputs(arch, args.export, inputs, mnn, torch.float64)
    print("each layer fed MNN's output of the layer before; max: largest abs difference / largest abs value; "
          "rms: root mean square difference / rms value; last: max at the last position (the logits' row)")
    print("| layer | kind | KV from | MNN vs fp64: max | rms | last | torch fp32 vs fp64: max | rms | last | "
          "MNN vs torch fp32: max |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for i, layer in enumerate(layers):
        exact = fp64[i]
        ours = torch.from_numpy(mnn[i]).double().view_as(exact)
        kind = getattr(layer, "kind", "sparse" if getattr(layer, "sparse", False) else "dense")
        source = getattr(layer, "kv_source", -1)
        print(f"| {i} | {kind} | {source if source >= 0 else '-'} | {' | '.join(_errors(ours, exact))} | "
              f"{' | '.join(_errors(fp32[i], exact))} | {_errors(ours, fp32[i], exact)[0]} |")


def _errors(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor | None = None) -> list[str]:
    """max, rms and last-position errors of ``got`` (see main's table), relative to ``scale``."""
    scale = want if scale is None else scale
    diff = (got - want).reshape(-1, got.shape[-1])
    values = [diff.abs().max() / scale.abs().max(), diff.pow(2).mean().sqrt() / scale.pow(2).mean().sqrt(),
              diff[-1].abs().max() / scale.reshape(-1, got.shape[-1])[-1].abs().max()]
    return [f"{float(v):.3g}" for v in values]

if __name__ == "__main__":
    main()
