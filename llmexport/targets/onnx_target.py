"""The ONNX target: one standard-op ``llm.onnx`` with the checkpoint's weights as fp32
initializers, which onnxruntime runs (no quantization, no token table, no runtime files)."""

from __future__ import annotations

from llmexport.models.base import Architecture
from llmexport.planning.memory_plan import onnx_export_peak_bytes
from llmexport.quant.scheme import QuantScheme
from llmexport.results import ExportPlan
from llmexport.spec import LinearSpec
from llmexport.targets.base import TRACE_SEQ_LEN, ExportJob, OutputTarget


class OnnxTarget(OutputTarget):
    def record_bytes(self, spec: LinearSpec, scheme: QuantScheme) -> int:
        """fp32 weight and bias initializers, whatever the scheme."""
        return 4 * spec.out_features * (spec.in_features + int(spec.bias))

    def export_peak_bytes(self, arch: Architecture, plan: ExportPlan) -> int:
        return onnx_export_peak_bytes(plan)

    def write(self, job: ExportJob) -> None:
        from llmexport.trace.eager import bind_weights
        from llmexport.trace.onnx_export import export_onnx

        with job.stage("onnx"):
            bind_weights(job.graph, job.arch.linear_weight)
            export_onnx(job.graph, job.arch.graph_inputs(TRACE_SEQ_LEN), job.out / "llm.onnx", for_mnn=False)
