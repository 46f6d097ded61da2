"""Where each exported linear's weights come from: the family's checkpoint tensors, or, for a
linear an MLX-quantized checkpoint keeps as stored (llmexport.schemes), MLX's own integers."""

from __future__ import annotations

from typing import Any

import torch

from llmexport.models.base import Architecture
from llmexport.schemes import Schemes


class WeightSources:
    """The weights of an export's text linears, as its schemes need them."""

    def __init__(self, arch: Architecture, schemes: Schemes):
        self.arch, self.schemes = arch, schemes

    def weight(self, name: str) -> tuple[Any, torch.Tensor | None]:
        """A transcoded linear's ``Prequantized`` integers (and bias), else the family's weights."""
        mlx = self.schemes.mlx
        if mlx is None or not self.schemes.stored(name):
            return self.arch.linear_weight(name)
        source = self.arch.linear_source(name)
        bias = mlx.tensor(source.bias) if source.bias else None
        return mlx.prequantized(source.weight, source.expert), bias
