"""The export stages, in order, writing into a staging folder.

HF folder -> Architecture -> rewritten graph -> ONNX -> MNN graph -> rebuilt llm.mnn with
weights streamed into llm.mnn.weight -> embedding/PLE files -> configs -> tokenizer.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from llmexport.api import ExportResult
from llmexport.checkpoint import Checkpoint
from llmexport.errors import InputError, OutputError
from llmexport.mnn import config as mnn_config
from llmexport.models import architecture_for
from llmexport.models.base import Architecture
from llmexport.options import ExportFormat, ExportOptions
from llmexport.export_plan import export_plan, write_manifest

log = logging.getLogger(__name__)
TRACE_SEQ_LEN = 3


@contextmanager
def _stage(timings: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    log.info("stage %s ...", name)
    try:
        yield
    except OSError as exc:
        raise OutputError(f"{name}: writing the export failed ({exc.strerror or exc})") from None
    finally:
        timings[name] = round(time.perf_counter() - start, 3)


def run_export(path: Path, out: Path, options: ExportOptions) -> ExportResult:
    timings: dict[str, float] = {}
    with _stage(timings, "load"):
        checkpoint = Checkpoint.open(path)
        arch = architecture_for(checkpoint)
        graph = arch.build_graph()
    plan = export_plan(arch, options)
    for adjusted in plan["adjusted_blocks"]:
        log.info("block %d does not divide %s (width %d): using %d", adjusted["requested"], adjusted["name"],
                 adjusted["in_features"], adjusted["used"])
    if options.export is ExportFormat.ONNX:
        _export_reference_onnx(arch, graph, out, timings)
    else:
        _export_mnn(arch, graph, checkpoint, out, options, timings)
    result = ExportResult(out, [], plan, timings)
    if options.verify and options.export is ExportFormat.MNN:
        from llmexport.verify import verify_export

        with _stage(timings, "verify"):
            result.verification = verify_export(out, path, raise_on_failure=True)
    with _stage(timings, "manifest"):
        write_manifest(out, arch, options, plan)
    result.files = sorted(p.name for p in out.iterdir())
    return result


def dry_run(path: Path, options: ExportOptions) -> dict:
    """The plan of an export, computed without writing anything."""
    return export_plan(architecture_for(Checkpoint.open(path)), options)


def _export_reference_onnx(arch: Architecture, graph, out: Path, timings: dict[str, float]) -> None:
    """Standard-op ONNX with the checkpoint weights as initializers (runs in onnxruntime)."""
    from llmexport.eager import bind_weights
    from llmexport.onnx_export import export_onnx

    with _stage(timings, "onnx"):
        bind_weights(graph, arch.linear_weight)
        export_onnx(graph, arch.graph_inputs(TRACE_SEQ_LEN), out / "llm.onnx", for_mnn=False)


def _export_mnn(arch: Architecture, graph, checkpoint: Checkpoint, out: Path, options: ExportOptions,
                timings: dict[str, float]) -> None:
    from llmexport.mnn.convert import json_to_mnn, mnn_to_json, onnx_to_mnn
    from llmexport.mnn.rebuild import rebuild_graph
    from llmexport.onnx_export import export_onnx

    work = out / ".work"
    work.mkdir()
    with _stage(timings, "onnx"):
        export_onnx(graph, arch.graph_inputs(TRACE_SEQ_LEN), work / "llm.onnx", for_mnn=True)
    with _stage(timings, "convert"):
        onnx_to_mnn(work / "llm.onnx", work / "llm.mnn")
        graph_json = mnn_to_json(work / "llm.mnn", work / "llm.mnn.json")
        experts = _convert_expert_template(arch, work)
    with _stage(timings, "weights"), open(out / mnn_config.LLM_WEIGHT, "wb") as weight_file:
        rebuilt = rebuild_graph(graph_json, arch.linears(), arch.linear_weight, options.scheme_for, weight_file,
                                use_gpu=options.use_gpu, experts=experts)
    with _stage(timings, "rebuild"):
        json_to_mnn(rebuilt.graph, work / "llm.rebuilt.json", out / mnn_config.LLM_MODEL)
    files: dict[str, Any] = {}
    with _stage(timings, "embeddings"):
        embedding_file = _write_tables(arch, out, options, rebuilt.records, files)
    with _stage(timings, "configs"):
        mnn_config.write_json(out / "llm_config.json", mnn_config.llm_config(arch.llm_config(), files))
        mnn_config.write_json(out / "config.json", mnn_config.runtime_config(
            arch.runtime_config(), options.thread_num, embedding_file))
    with _stage(timings, "tokenizer"):
        _write_tokenizer(checkpoint, out)
    _remove_tree(work)


def _convert_expert_template(arch: Architecture, work: Path):
    """Trace and convert the one-expert template graph (None when the family has no experts)."""
    import torch

    from llmexport.mnn.convert import mnn_to_json, onnx_to_mnn
    from llmexport.models.base import GraphInputs
    from llmexport.onnx_export import export_onnx

    template = arch.expert_template()
    if template is None:
        return None
    inputs = GraphInputs((torch.randn(TRACE_SEQ_LEN, template.hidden_size),), ["hidden_states"],
                         {"hidden_states": {0: "tokens"}}, ["expert_out"])
    export_onnx(template.module, inputs, work / "expert.onnx", for_mnn=True)
    onnx_to_mnn(work / "expert.onnx", work / "expert.mnn")
    return mnn_to_json(work / "expert.mnn", work / "expert.json"), template


def _write_tables(arch: Architecture, out: Path, options: ExportOptions, records, files: dict[str, Any]) -> str | None:
    """Embedding and PLE files; returns the embedding file name config.json must name."""
    from llmexport.mnn.embeddings import write_embedding_table

    embedding_file = None
    if arch.tied_embedding:
        lm = records["lm_head"]
        files["tie_embeddings"] = {
            "weight_offset": lm.weight_offset, "alpha_offset": lm.alpha_offset, "alpha_size": lm.alpha_bytes,
            "quant_bit": lm.bits, "quant_block": lm.block, "alpha_dtype": "fp16"}
    else:
        embedding_file = mnn_config.embedding_file_name(options.table_bits)
        with open(out / embedding_file, "wb") as f:
            rec = _table(write_embedding_table, f, arch.embedding_table(), options, "embedding")
        if options.table_bits != 16:
            files["tie_embeddings"] = {
                "weight_offset": 0, "alpha_offset": rec.weight_bytes, "alpha_size": rec.alpha_bytes,
                "quant_bit": rec.bits, "quant_block": rec.block, "alpha_dtype": "fp32"}
    ple = arch.ple_table()
    if ple is not None:
        name = mnn_config.ple_file_name(options.table_bits)
        with open(out / name, "wb") as f:
            rec = _table(write_embedding_table, f, ple, options, "PLE")
        files["ple_embed_file"] = name
        if options.table_bits != 16:
            files["ple_quant"] = [0, rec.weight_bytes, rec.alpha_bytes, rec.bits, rec.block]
    return embedding_file


def _table(writer, fileobj, table, options: ExportOptions, what: str):
    try:
        return writer(fileobj, table, options.table_bits, options.quant.block)
    except ValueError as exc:
        raise InputError(f"--embed_bit/--quant_block: {what} table of width {table.shape[-1]}: {exc}") from None


def _write_tokenizer(checkpoint: Checkpoint, out: Path) -> None:
    from llmexport.mnn.tokenizer import write_mnn_tokenizer

    checkpoint.tokenizer_file()
    try:
        write_mnn_tokenizer(checkpoint.path, out / mnn_config.TOKENIZER_FILE)
    except ValueError as exc:
        raise InputError(str(exc)) from None


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
