"""The MNN target: the folder MNN's LLM runtime loads.

Each graph (the text decoder, then each tower) is traced to ONNX, converted by MNN's converter,
and rebuilt with its linears streamed from the checkpoint into ``{stem}.mnn.weight`` (llmexport.mnn.rebuild);
then the token table, config.json / llm_config.json and the tokenizer. Every byte layout, file
name, config key and limit is llmexport.mnn's; this module only runs the stages in order.
"""

from __future__ import annotations

import functools
import logging
import shutil
from pathlib import Path
from typing import Any

from llmexport.calibration.activation_scaling import scale_and_fold
from llmexport.calibration.data import read_texts
from llmexport.calibration.gptq import calibrate
from llmexport.errors import InputError
from llmexport.mnn import config as mnn_config
from llmexport.mnn.embeddings import table_size
from llmexport.mnn.weights import record_size
from llmexport.models.base import Architecture
from llmexport.options import ExportOptions
from llmexport.planning.memory_plan import mnn_export_peak_bytes
from llmexport.planning.weight_sources import WeightSources
from llmexport.progress import Progress
from llmexport.quant.methods import quantizers
from llmexport.quant.scheme import QuantScheme
from llmexport.results import ExportPlan
from llmexport.source.checkpoint import Checkpoint
from llmexport.spec import GraphInputs, LinearSpec
from llmexport.targets.base import TRACE_SEQ_LEN, ExportJob, OutputTarget
from llmexport.targets.token_table_writer import TokenTableWriter, table_errors

log = logging.getLogger(__name__)


class MnnTarget(OutputTarget):
    verifiable = True

    def prepare(self, checkpoint: Checkpoint, arch: Architecture, options: ExportOptions) -> bytes:
        """The runtime's tokenizer file, converted in memory (unsupported tokenizers fail here)."""
        from llmexport.mnn.tokenizer.writer import mnn_tokenizer_bytes

        checkpoint.tokenizer_file()
        checkpoint.check_tokenizer_side_files()
        if options.calibration is not None:  # bad text files fail before anything is written
            read_texts(options.calibration.data)
        if options.verify_text is not None:
            read_texts(options.verify_text.path, "--verify_text")
        try:
            return mnn_tokenizer_bytes(checkpoint.path, end_of_turn=arch.end_of_turn_tokens(),
                                       approximate_ignore_merges=options.approximate_ignore_merges)
        except ValueError as exc:
            raise InputError(str(exc)) from None

    def record_bytes(self, spec: LinearSpec, scheme: QuantScheme) -> int:
        return record_size(spec.out_features, spec.in_features, scheme, spec.bias)

    def export_peak_bytes(self, arch: Architecture, plan: ExportPlan) -> int:
        return mnn_export_peak_bytes(arch, plan)

    def table_bytes(self, rows: int, dim: int, bits: int, block: int) -> int:
        return table_size(rows, dim, bits, block)

    def write(self, job: ExportJob) -> None:
        arch, options, out, graph = job.arch, job.options, job.out, job.graph
        work = out / ".work"
        work.mkdir()
        family_llm, family_runtime = dict(arch.llm_config()), dict(arch.runtime_config())  # reads files: fail early
        quantize = quantizers(options.use_gpu)
        calibrated = None
        calibration = options.calibration
        if calibration is not None and calibration.method.scaling:
            with job.stage("scaling"):
                arch, graph = _scaled(arch, job, quantize)
        if calibration is not None and calibration.method.gptq:
            with job.stage("calibration"):
                calibrated = calibrate(arch, calibration, job.schemes.linear, quantize, work / "calibration",
                                       options.trust_remote_code)
        sources = WeightSources(arch, job.schemes, calibrated)
        graphs = _GraphWriter(job, work, quantize)
        table = TokenTableWriter(job.schemes, out, job.digests)  # on its own thread while the graph converts
        try:
            llm_json = graphs.convert("llm", graph, arch.graph_inputs(TRACE_SEQ_LEN))
            experts = _convert_expert_templates(arch, work)
            with job.stage("embeddings"):  # waited for before the weights: the two never hold memory at once
                table_record = table.result()
        except BaseException:
            table.cancel()
            raise
        job.timings["embeddings_background"] = table.elapsed  # the table's own time, beside the conversion
        rebuilt = graphs.rebuild("llm", llm_json, arch.linears(), sources.weight, job.schemes.linear,
                                 arch.linear_source, experts)
        files: dict[str, Any] = {}
        if any(op.get("type") == "LinearAttention" for op in rebuilt.graph["oplists"]):
            files[mnn_config.RECURRENT_STATE] = True  # the runners never cut such a history back
        towers = arch.towers()
        tail = _media_token_tail(arch, job.schemes) if towers else None
        for tower in towers:
            graphs.write(tower.name, tower.build_graph(tail), tower.graph_inputs(), tower.linears(),
                         tower.linear_weight, functools.partial(job.schemes.tower, tower.name),
                         tower.linear_source)
            family_llm.update(tower.llm_config())
            family_runtime.update(tower.runtime_config())
        embedding_file = table_config(table, table_record, rebuilt.records, files)
        with job.stage("configs"):
            if options.chat_thinking.template_context() and "jinja" not in family_llm:
                log.warning("--chat_thinking: the checkpoint has no chat template; nothing to set")
            mnn_config.write_json(out / "llm_config.json", mnn_config.llm_config(
                family_llm, files, options.chat_thinking.template_context()))
            mnn_config.write_json(out / "config.json", mnn_config.runtime_config(
                family_runtime, options.thread_num, embedding_file, options.runtime_profile, options.precision))
        with job.stage("tokenizer"):
            (out / mnn_config.TOKENIZER_FILE).write_bytes(job.prepared)
        shutil.rmtree(work, ignore_errors=True)


def _scaled(arch: Architecture, job: ExportJob, quantize) -> tuple[Architecture, Any]:
    """The model with activation-aware scales folded in (llmexport.calibration.activation_scaling), its graph
    (the norms are graph constants) and the folded norms saved for verification."""
    from safetensors.torch import save_file

    options = job.options
    assert options.calibration is not None
    scaled = scale_and_fold(arch, options.calibration, job.schemes.linear, quantize, options.trust_remote_code)
    if scaled.weights.norms:
        save_file({name: value.contiguous() for name, value in scaled.weights.norms.items()},
                  str(job.out / mnn_config.FOLDED_NORMS))
    return scaled.arch, scaled.arch.build_graph()


class _GraphWriter:
    """One graph: trace -> ONNX -> MNN -> JSON -> rebuilt with streamed weights -> {stem}.mnn(.weight)."""

    def __init__(self, job: ExportJob, work: Path, quantizers):
        self.job, self.work, self.quantizers = job, work, quantizers

    def write(self, stem: str, graph, inputs, linears, weight_fn, scheme_fn, source_of, experts=()):
        """``source_of`` names the checkpoint tensor behind a linear (LinearSource) in error messages."""
        return self.rebuild(stem, self.convert(stem, graph, inputs), linears, weight_fn, scheme_fn, source_of,
                            experts)

    def convert(self, stem: str, graph, inputs) -> dict[str, Any]:
        """Trace -> ONNX -> MNN -> its JSON (the graph with placeholder linears)."""
        from llmexport.mnn.convert import mnn_to_json, onnx_to_mnn
        from llmexport.trace.onnx_export import export_onnx

        job, work = self.job, self.work
        label = "" if stem == "llm" else f"{stem}_"
        with job.stage(f"{label}onnx"):
            export_onnx(graph, inputs, work / f"{stem}.onnx", for_mnn=True)
        with job.stage(f"{label}convert"):
            onnx_to_mnn(work / f"{stem}.onnx", work / f"{stem}.mnn")
            return mnn_to_json(work / f"{stem}.mnn", work / f"{stem}.mnn.json")

    def rebuild(self, stem: str, graph_json, linears, weight_fn, scheme_fn, source_of, experts=()):
        """The converted graph with its linears streamed from the checkpoint into {stem}.mnn.weight."""
        from llmexport.mnn.convert import json_to_mnn
        from llmexport.mnn.external import rehome_external
        from llmexport.mnn.rebuild import NonFiniteLinear, rebuild_graph

        job, work, out = self.job, self.work, self.job.out
        label = "" if stem == "llm" else f"{stem}_"
        linears = list(linears)
        total = sum(spec.in_features * spec.out_features for spec in linears)
        with job.stage(f"{label}weights"), job.digests.open(out / f"{stem}.mnn.weight") as weight_file, \
                Progress(f"{stem} weights", total, job.options.quiet, unit="param") as progress:
            try:
                rebuilt = rebuild_graph(graph_json, linears, weight_fn, scheme_fn, weight_file, self.quantizers,
                                        experts=experts, progress=progress.update)
            except NonFiniteLinear as exc:
                source = source_of(exc.linear)
                row = f" (expert {source.expert})" if source.expert is not None else ""
                raise InputError(f"tensor {source.weight!r}{row}: {exc.reason}") from None
            # Constants the converter moved out of the graph (norms wider than 1024, tables, convolutions).
            rehome_external(rebuilt.graph, work / f"{stem}.mnn.weight", weight_file, skip=rebuilt.records)
        with job.stage(f"{label}rebuild"):
            json_to_mnn(rebuilt.graph, work / f"{stem}.rebuilt.json", out / f"{stem}.mnn")
        return rebuilt


def _convert_expert_templates(arch: Architecture, work: Path) -> list:
    """Trace and convert each expert template graph: [(converted JSON, template), ...]."""
    import torch

    from llmexport.mnn.convert import mnn_to_json, onnx_to_mnn
    from llmexport.trace.onnx_export import export_onnx

    converted = []
    for i, template in enumerate(arch.expert_templates()):
        inputs = GraphInputs((torch.randn(TRACE_SEQ_LEN, template.hidden_size),), ["hidden_states"],
                             {"hidden_states": {0: "tokens"}}, ["expert_out"])
        export_onnx(template.module, inputs, work / f"expert{i}.onnx", for_mnn=True)
        onnx_to_mnn(work / f"expert{i}.onnx", work / f"expert{i}.mnn")
        converted.append((mnn_to_json(work / f"expert{i}.mnn", work / f"expert{i}.json"), template))
    return converted


def table_config(table: TokenTableWriter, record, records, files: dict[str, Any]) -> str | None:
    """What config.json and llm_config.json say of the token table; returns the embedding file name
    config.json must name (None: the runtime reads the tied lm_head record)."""
    if record is None:
        files["tie_embeddings"] = mnn_config.TableKeys.of_record(records["lm_head"]).to_config()
        return None
    files["hidden_size"] = record.dim  # the width the runtime reads a row at (embedding + PLE)
    if record.bits != 16:
        files["tie_embeddings"] = mnn_config.TableKeys.of_table(record).to_config()
    return table.file_name


def _media_token_tail(arch: Architecture, schemes):
    """What a soft token carries after its features: the PLE columns of the media id's row as
    the token table stores it (mnn/token_table.py); None when the table has no such columns."""
    from llmexport.mnn.token_table import split_rows, stored_row

    tables = schemes.tables()
    if "embedding" not in tables or arch.ple_table() is None:
        return None
    table, choice = tables["embedding"]
    with table_errors(table, "embedding"):
        row = stored_row(choice.rows, arch.media_ple_id(), choice.bits, choice.block, choice.quantizer)
    return split_rows(arch, row)[1]
