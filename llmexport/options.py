"""Typed export options and their cross-checks (the CLI only parses into these)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from llmexport.errors import UsageError
from llmexport.models.base import LinearRole, LinearSpec
from llmexport.quant.scheme import QuantScheme

EMBED_BITS = (16, 8, 4)


class ExportFormat(str, Enum):
    MNN = "mnn"
    ONNX = "onnx"


@dataclass(frozen=True)
class ExportOptions:
    """Everything that decides what an export writes.

    ``quant`` applies to every linear; ``lm_quant`` (default: ``quant``) to lm_head, which a
    tied model's runtime also reads as its token embedding. ``embed_bit`` is the width of the
    embedding/PLE tables the runtime reads from their own files.
    """

    export: ExportFormat = ExportFormat.MNN
    quant: QuantScheme = field(default_factory=lambda: QuantScheme(bits=4, block=64))
    lm_quant: QuantScheme | None = None
    embed_bit: int = 16
    verify: bool = False
    quiet: bool = False
    thread_num: int = 4

    def validate(self) -> "ExportOptions":
        for flag, scheme in (("--quant_bit/--quant_block", self.quant), ("--lm_quant_bit", self.lm_quant)):
            if scheme is None:
                continue
            try:
                scheme.validate()
            except ValueError as exc:
                raise UsageError(f"{flag}: {exc}") from None
        if self.embed_bit not in EMBED_BITS:
            raise UsageError(f"--embed_bit: {self.embed_bit} is not one of {', '.join(map(str, EMBED_BITS))}")
        if self.thread_num < 1:
            raise UsageError(f"--thread_num: must be >= 1, got {self.thread_num}")
        return self

    def scheme_for(self, spec: LinearSpec) -> QuantScheme:
        """The quantization scheme of one linear layer."""
        if spec.role is LinearRole.LM_HEAD and self.lm_quant is not None:
            return self.lm_quant
        return self.quant
