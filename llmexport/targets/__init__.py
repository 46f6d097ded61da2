"""Output targets, one per ``--export`` format (llmexport/targets/base.py says what a target is)."""

from __future__ import annotations

from llmexport.options import ExportFormat
from llmexport.targets.base import ExportJob, OutputTarget, stage

__all__ = ["ExportJob", "OutputTarget", "stage", "target_for"]


def target_for(export_format: ExportFormat) -> OutputTarget:
    """The target that writes one format."""
    from llmexport.targets.mnn_target import MnnTarget
    from llmexport.targets.onnx_target import OnnxTarget

    targets: dict[ExportFormat, type[OutputTarget]] = {ExportFormat.MNN: MnnTarget, ExportFormat.ONNX: OnnxTarget}
    return targets[export_format]()
