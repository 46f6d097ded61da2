"""The export stages, in order, writing into a staging folder.

HF folder -> Architecture -> rewritten graph -> ONNX -> MNN graph -> rebuilt llm.mnn with
weights streamed into llm.mnn.weight -> embedding/PLE files -> configs -> tokenizer.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from llmexport.checkpoint import Checkpoint
from llmexport.errors import ConversionError, InputError, OutputError, ResourceError, UsageError
from llmexport.export_plan import export_plan, write_manifest
from llmexport.loading import open_architecture
from llmexport.memory_plan import check_fits
from llmexport.mnn import config as mnn_config
from llmexport.models.base import Architecture
from llmexport.options import ExportFormat, ExportOptions
from llmexport.progress import Progress
from llmexport.quant.rtn import NonFiniteError
from llmexport.results import ExportPlan, ExportResult, VerifyReport
from llmexport.weight_sources import WeightSources

log = logging.getLogger(__name__)
TRACE_SEQ_LEN = 3


@contextmanager
def _stage(timings: dict[str, float], name: str) -> Iterator[None]:
    """Time a stage; an OSError inside a writing stage is the destination failing, and memory
    running out is a resource error that names the stage."""
    start = time.perf_counter()
    log.info("stage %s ...", name)
    try:
        yield
    except OSError as exc:
        raise OutputError(f"{name}: writing the export failed ({exc.strerror or exc})") from None
    except (MemoryError, RuntimeError) as exc:
        out_of_memory = ResourceError.out_of_memory(exc, f"during the {name} stage")
        if out_of_memory is None:
            raise
        raise out_of_memory from None
    finally:
        timings[name] = round(time.perf_counter() - start, 3)


def _load(path: Path, options: ExportOptions) -> tuple[Checkpoint, Architecture, bytes | None]:
    """Open and check everything the export reads before any heavy work: config, weights'
    headers, the architecture, the tokenizer (converted in memory), the verification's needs."""
    checkpoint = Checkpoint.open(path)
    arch = open_architecture(checkpoint)
    tokenizer = _tokenizer_bytes(checkpoint, arch) if options.export is ExportFormat.MNN else None
    if options.verify and arch.reference_is_remote_code and not options.trust_remote_code:
        raise UsageError(f"--verify: the {arch.describe().family} reference model is the checkpoint's own code "
                         f"({', '.join(sorted(p.name for p in path.glob('*.py'))) or 'auto_map'}); pass "
                         "--trust_remote_code to allow running it")
    return checkpoint, arch, tokenizer


def run_export(path: Path, out: Path, options: ExportOptions) -> ExportResult:
    timings: dict[str, float] = {}
    start = time.perf_counter()
    _, arch, tokenizer = _load(path, options)  # reading only: input errors, never output errors
    graph = arch.build_graph()
    sources = WeightSources(arch, options)
    timings["load"] = round(time.perf_counter() - start, 3)
    plan = export_plan(arch, options, sources)
    assert plan.memory is not None  # export_plan estimates it
    check_fits(plan.memory, options.max_memory)  # before any heavy stage
    for adjusted in plan.adjusted_blocks:
        log.info("block %d does not divide %s (width %d): using %d", adjusted.requested, adjusted.name,
                 adjusted.in_features, adjusted.used)
    if options.export is ExportFormat.ONNX:
        _export_reference_onnx(arch, graph, out, timings)
    else:
        assert tokenizer is not None  # _load converts it for every MNN export
        _export_mnn(arch, graph, tokenizer, out, options, timings, sources)
    verification: VerifyReport | None = None
    verify_error: str | None = None
    if options.verify and options.export is ExportFormat.MNN:
        with _stage(timings, "verify"):
            verification, verify_error = _verify(out, path, options)
    with _stage(timings, "manifest"):
        write_manifest(out, options, plan)
    return ExportResult(out, tuple(sorted(p.name for p in out.iterdir())), plan, timings, verification, verify_error)


#: what stops a verification from running without saying anything about the export: resources
#: (also torch's allocator failing: ResourceError.out_of_memory), the runtime crashing or timing out
#: on it (MNN's runtime runs in child processes)
_VERIFY_CANNOT_RUN = (MemoryError, ConversionError, subprocess.TimeoutExpired)


def _verify(out: Path, path: Path, options: ExportOptions) -> tuple[VerifyReport | None, str | None]:
    """The verification report, or why it could not run: a finished export is never discarded
    for that (verify.json records the reason); a verification that ran and disagreed raises,
    unless ``keep_failed`` (then the failing report comes back and the export is kept)."""
    from llmexport.verification import verify_export

    try:
        return verify_export(out, path, raise_on_failure=not options.keep_failed,
                             trust_remote_code=options.trust_remote_code), None
    except Exception as exc:
        if not isinstance(exc, _VERIFY_CANNOT_RUN) and ResourceError.out_of_memory(exc, "") is None:
            raise
        reason = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
        log.warning("verify could not run: %s", reason)
        (out / "verify.json").write_text(json.dumps({"ran": False, "error": reason, "passed": False}, indent=2))
        return None, reason


def dry_run(path: Path, options: ExportOptions) -> ExportPlan:
    """The plan of an export, computed without writing anything (after the same input checks)."""
    _, arch, _ = _load(path, options)
    return export_plan(arch, options)


def _export_reference_onnx(arch: Architecture, graph, out: Path, timings: dict[str, float]) -> None:
    """Standard-op ONNX with the checkpoint weights as initializers (runs in onnxruntime)."""
    from llmexport.eager import bind_weights
    from llmexport.onnx_export import export_onnx

    with _stage(timings, "onnx"):
        bind_weights(graph, arch.linear_weight)
        export_onnx(graph, arch.graph_inputs(TRACE_SEQ_LEN), out / "llm.onnx", for_mnn=False)


def _export_mnn(arch: Architecture, graph, tokenizer: bytes, out: Path, options: ExportOptions,
                timings: dict[str, float], sources: WeightSources) -> None:
    work = out / ".work"
    work.mkdir()
    family_llm, family_runtime = dict(arch.llm_config()), dict(arch.runtime_config())  # reads files: fail early
    rebuilt = _export_graph("llm", graph, arch.graph_inputs(TRACE_SEQ_LEN), arch.linears(), sources.weight,
                            sources.scheme, out, work, options, timings, _convert_expert_templates(arch, work),
                            source_of=arch.linear_source)
    files: dict[str, Any] = {}
    towers = arch.towers()
    tail = _media_token_tail(arch, sources) if towers else None
    for tower in towers:
        _export_graph(tower.name, tower.build_graph(tail), tower.graph_inputs(), tower.linears(), tower.linear_weight,
                      lambda spec, t=tower: options.tower_scheme(t.name), out, work, options, timings,
                      source_of=tower.linear_source)
        family_llm.update(tower.llm_config())
        family_runtime.update(tower.runtime_config())
    with _stage(timings, "embeddings"):
        embedding_file = _write_tables(arch, out, sources, rebuilt.records, files)
    with _stage(timings, "configs"):
        if options.chat_thinking.template_context() and "jinja" not in family_llm:
            log.warning("--chat_thinking: the checkpoint has no chat template; nothing to set")
        mnn_config.write_json(out / "llm_config.json", mnn_config.llm_config(
            family_llm, files, options.chat_thinking.template_context()))
        mnn_config.write_json(out / "config.json", mnn_config.runtime_config(
            family_runtime, options.thread_num, embedding_file, options.runtime_profile))
    with _stage(timings, "tokenizer"):
        (out / mnn_config.TOKENIZER_FILE).write_bytes(tokenizer)
    shutil.rmtree(work, ignore_errors=True)


def _export_graph(stem: str, graph, inputs, linears, weight_fn, scheme_fn, out: Path, work: Path,
                  options: ExportOptions, timings: dict[str, float], experts=(), source_of=None):
    """One graph: trace -> ONNX -> MNN -> JSON -> rebuilt with streamed weights -> {stem}.mnn(.weight).
    ``source_of`` names the checkpoint tensor behind a linear (LinearSource) in error messages."""
    from llmexport.mnn.convert import json_to_mnn, mnn_to_json, onnx_to_mnn
    from llmexport.mnn.external import rehome_external
    from llmexport.mnn.rebuild import NonFiniteLinear, rebuild_graph
    from llmexport.onnx_export import export_onnx

    label = "" if stem == "llm" else f"{stem}_"
    with _stage(timings, f"{label}onnx"):
        export_onnx(graph, inputs, work / f"{stem}.onnx", for_mnn=True)
    with _stage(timings, f"{label}convert"):
        onnx_to_mnn(work / f"{stem}.onnx", work / f"{stem}.mnn")
        graph_json = mnn_to_json(work / f"{stem}.mnn", work / f"{stem}.mnn.json")
    linears = list(linears)
    total = sum(spec.in_features * spec.out_features for spec in linears)
    with _stage(timings, f"{label}weights"), open(out / f"{stem}.mnn.weight", "wb") as weight_file, \
            Progress(f"{stem} weights", total, options.quiet, unit="param") as progress:
        try:
            rebuilt = rebuild_graph(graph_json, linears, weight_fn, scheme_fn, weight_file,
                                    use_gpu=options.use_gpu, experts=experts, progress=progress.update)
        except NonFiniteLinear as exc:
            source = source_of(exc.linear)
            row = f" (expert {source.expert})" if source.expert is not None else ""
            raise InputError(f"tensor {source.weight!r}{row}: {exc.reason}") from None
        # Constants the converter moved out of the graph (norms wider than 1024, tables, convolutions).
        rehome_external(rebuilt.graph, work / f"{stem}.mnn.weight", weight_file, skip=rebuilt.records)
    with _stage(timings, f"{label}rebuild"):
        json_to_mnn(rebuilt.graph, work / f"{stem}.rebuilt.json", out / f"{stem}.mnn")
    return rebuilt


def _convert_expert_templates(arch: Architecture, work: Path) -> list:
    """Trace and convert each expert template graph: [(converted JSON, template), ...]."""
    import torch

    from llmexport.mnn.convert import mnn_to_json, onnx_to_mnn
    from llmexport.onnx_export import export_onnx
    from llmexport.spec import GraphInputs

    converted = []
    for i, template in enumerate(arch.expert_templates()):
        inputs = GraphInputs((torch.randn(TRACE_SEQ_LEN, template.hidden_size),), ["hidden_states"],
                             {"hidden_states": {0: "tokens"}}, ["expert_out"])
        export_onnx(template.module, inputs, work / f"expert{i}.onnx", for_mnn=True)
        onnx_to_mnn(work / f"expert{i}.onnx", work / f"expert{i}.mnn")
        converted.append((mnn_to_json(work / f"expert{i}.mnn", work / f"expert{i}.json"), template))
    return converted


def _write_tables(arch: Architecture, out: Path, sources: WeightSources, records,
                  files: dict[str, Any]) -> str | None:
    """The token table (mnn/token_table.py); returns the embedding file name config.json must name."""
    tables = sources.tables()
    if "embedding" not in tables:  # the runtime reads the tied lm_head record
        lm = records["lm_head"]
        files["tie_embeddings"] = {
            "weight_offset": lm.weight_offset, "alpha_offset": lm.alpha_offset, "alpha_size": lm.alpha_bytes,
            "quant_bit": lm.bits, "quant_block": lm.block, "alpha_dtype": "fp32" if lm.alpha_fp32 else "fp16"}
        return None
    table, choice = tables["embedding"]
    embedding_file = mnn_config.embedding_file_name(choice.bits)
    with open(out / embedding_file, "wb") as f:
        rec = _table(f, table, choice, "embedding")
    files["hidden_size"] = rec.dim  # the width the runtime reads a row at (embedding + PLE)
    if choice.bits != 16:
        files["tie_embeddings"] = {
            "weight_offset": 0, "alpha_offset": rec.weight_bytes, "alpha_size": rec.alpha_bytes,
            "quant_bit": rec.bits, "quant_block": rec.block, "alpha_dtype": "fp32"}
    return embedding_file


def _media_token_tail(arch: Architecture, sources: WeightSources):
    """What a soft token carries after its features: the PLE columns of the media id's row as
    the token table stores it (mnn/token_table.py); None when the table has no such columns."""
    from llmexport.mnn.token_table import split_rows, stored_row

    tables = sources.tables()
    if "embedding" not in tables or arch.ple_table() is None:
        return None
    table, choice = tables["embedding"]
    with _table_errors(table, "embedding"):
        row = stored_row(table, arch.media_ple_id(), choice.bits, choice.block, choice.quantizer)
    return split_rows(arch, row)[1]


def _table(fileobj, table, choice, what: str):
    from llmexport.mnn.embeddings import write_embedding_table

    with _table_errors(table, what):
        return write_embedding_table(fileobj, choice.chunks(), choice.bits, choice.block, choice.quantizer)


@contextmanager
def _table_errors(table, what: str) -> Iterator[None]:
    """A table's values or its bits/block refused by the writer, as the input errors they are."""
    try:
        yield
    except NonFiniteError as exc:
        raise InputError(f"{what} table {table.name!r}: {exc}") from None
    except ValueError as exc:
        raise InputError(f"--embed_bit/--quant_block: {what} table of width {table.shape[-1]}: {exc}") from None


def _tokenizer_bytes(checkpoint: Checkpoint, arch: Architecture) -> bytes:
    """The runtime's tokenizer file, converted in memory (unsupported tokenizers fail here)."""
    from llmexport.mnn.tokenizer import mnn_tokenizer_bytes

    checkpoint.tokenizer_file()
    checkpoint.check_tokenizer_side_files()
    try:
        return mnn_tokenizer_bytes(checkpoint.path, end_of_turn=arch.end_of_turn_tokens())
    except ValueError as exc:
        raise InputError(str(exc)) from None
