"""Small pieces every family's trace-friendly graph is built from."""

from __future__ import annotations

import torch
from torch import nn

from llmexport.models.tensor_checks import TensorLookup
from llmexport.ops import rms_norm

__all__ = ["TensorLookup", "const", "Norm"]


def const(lookup: TensorLookup, name: str) -> nn.Parameter:
    """A small checkpoint tensor as an fp32 graph constant (norm gammas, scalars)."""
    return nn.Parameter(lookup(name).detach().float().clone(), requires_grad=False)


class Norm(nn.Module):
    """RMSNorm (``ops.rms_norm``); ``weight`` None: no scale."""

    def __init__(self, weight: torch.Tensor | None, eps: float):
        super().__init__()
        self.weight = None if weight is None else nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)
