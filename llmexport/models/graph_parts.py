"""Small pieces every family's trace-friendly graph is built from."""

from __future__ import annotations

import torch
from torch import nn

from llmexport.models.tensor_checks import TensorLookup
from llmexport.trace.ops import rms_norm

__all__ = ["TensorLookup", "const", "Norm", "head_outputs"]


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


def head_outputs(x: torch.Tensor, logits_index: torch.Tensor, norm: nn.Module, lm_head: nn.Module,
                 softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The runtime's outputs from the last layer's [1, seq, hidden]: positions from
    ``logits_index`` on, final-normed (``hidden_states``), through the head (``logits``), with
    tanh softcapping when ``softcap`` is set (Gemma3, Gemma4)."""
    x = x[:, logits_index.to(torch.int64):, :]
    hidden = norm(x)
    logits = lm_head(hidden)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits, hidden
