"""Where each exported linear's weights come from: the family's checkpoint tensors; for a linear
a pre-quantized (MLX, GPTQ, AWQ) checkpoint keeps as stored (llmexport.planning.schemes), its own integers; for a linear
GPTQ calibration rounded (llmexport.calibration.gptq), its precomputed levels."""

from __future__ import annotations

from typing import Any

import torch

from llmexport.calibration.gptq import CalibratedLinears
from llmexport.models.base import Architecture
from llmexport.planning.schemes import Schemes


class WeightSources:
    """The weights of an export's text linears, as its schemes need them."""

    def __init__(self, arch: Architecture, schemes: Schemes, calibrated: CalibratedLinears | None = None):
        self.arch, self.schemes, self.calibrated = arch, schemes, calibrated

    def weight(self, name: str) -> tuple[Any, torch.Tensor | None]:
        """A calibrated linear's ``Precomputed`` levels, a transcoded one's ``Prequantized``
        integers (each with its bias), else the family's weights."""
        if self.calibrated is not None and name in self.calibrated:
            return self.calibrated.weight(name), self.arch.linear_weight(name)[1]
        imported = self.schemes.imported
        if imported is None or not self.schemes.stored(name):
            return self.arch.linear_weight(name)
        source = self.arch.linear_source(name)
        bias = imported.tensor(source.bias) if source.bias else None
        return imported.prequantized(source.weight, source.expert), bias
