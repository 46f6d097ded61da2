"""Per-input-channel scales for a group of linears that read one input: AWQ's search and SmoothQuant's rule.

A linear ``y = W x`` computes the same with ``W diag(s)`` on ``x / s``. Where the op before the
linears can absorb ``1 / s`` exactly (llmexport/calibration/folding.py), the export stores ``W diag(s)``, and
the choice of ``s`` changes only what rounding does:

- AWQ (Lin et al., "AWQ: Activation-aware Weight Quantization for LLM Compression and
  Acceleration", 2023): ``s = mean|x|^alpha`` over the calibration inputs, ``alpha`` on a grid in
  [0, 1), normalised so that ``max(s) * min(s) = 1``; the ``alpha`` whose rounded weights give the
  group's smallest output error over the calibration inputs wins. Salient input channels (large
  activations) get larger weights, hence relatively finer levels. ``alpha = 0`` (no scaling) is on
  the grid: the search never picks scales worse than none on its own data.
- SmoothQuant (Xiao et al., "SmoothQuant: Accurate and Efficient Post-Training Quantization for
  Large Language Models", 2022): ``s = max|x|^alpha / max|W|^(1 - alpha)`` per input channel
  (``max|W|`` over every linear of the group), which moves activation outliers into the weights:
  for kernels that quantize activations on the fly (MNN's fast profile), not a weight-error search.

The output error of ``W`` rounded to ``Q`` is GPTQ's calibration loss ``tr((W - Q) H (W - Q)^T)``
with ``H = X^T X`` (llmexport.quant.gptq); for ``W diag(s)`` on inputs ``X diag(1/s)`` it is the
same loss with ``H / (s s^T)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from llmexport.quant.gptq import calibration_loss
from llmexport.spec import Quantizer

#: AWQ's grid: alpha = i / GRID for i in range(GRID) (the paper's 20 points)
GRID = 20
#: the smallest activation or weight magnitude a scale is computed from (a channel no
#: calibration token used must not get a zero or infinite scale)
FLOOR = 1e-5


@dataclass(frozen=True)
class Rounded:
    """One linear of a group as the search rounds it: its weight [out, in] and its scheme (``block``
    as the record uses it: ``QuantScheme.block_for`` of its width)."""

    weight: torch.Tensor
    bits: int
    block: int
    sym: bool


@dataclass(frozen=True)
class ScaleChoice:
    """The scales chosen for a group, and the group's output error with and without them."""

    scales: torch.Tensor
    alpha: float
    loss: float
    base_loss: float


def _normalised(magnitude: torch.Tensor, alpha: float) -> torch.Tensor:
    s = magnitude.double().clamp(min=FLOOR).pow(alpha)
    return (s / (s.max() * s.min()).sqrt()).float()


def group_loss(linears: Sequence[Rounded], hessian: torch.Tensor, scales: torch.Tensor, quantize: Quantizer) -> float:
    """The group's output error over the calibration inputs when each weight is stored as
    ``W diag(scales)`` rounded by ``quantize``."""
    h = hessian.double() / torch.outer(scales.double(), scales.double())
    total = 0.0
    for linear in linears:
        scaled = linear.weight.float() * scales
        total += calibration_loss(scaled, quantize(scaled, linear.bits, linear.block, linear.sym), h)
    return total


def awq_scales(linears: Sequence[Rounded], hessian: torch.Tensor, magnitude: torch.Tensor, quantize: Quantizer,
               expand: torch.Tensor | None = None) -> ScaleChoice:
    """AWQ's grid search (module docstring). ``magnitude``: mean |x| per scaled channel;
    ``expand``: for each input channel of the linears, the scaled channel it reads (None: one to one)."""
    def full(s: torch.Tensor) -> torch.Tensor:
        return s if expand is None else s[expand]

    ones = torch.ones_like(magnitude, dtype=torch.float32)
    base = group_loss(linears, hessian, full(ones), quantize)
    best = ScaleChoice(ones, 0.0, base, base)
    for i in range(1, GRID):
        scales = _normalised(magnitude, i / GRID)
        loss = group_loss(linears, hessian, full(scales), quantize)
        if loss < best.loss:
            best = ScaleChoice(scales, i / GRID, loss, base)
    return best


def smooth_scales(activation_max: torch.Tensor, weight_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's ``max|x|^alpha / max|W|^(1 - alpha)`` per channel (module docstring)."""
    s = activation_max.double().clamp(min=FLOOR).pow(alpha) / weight_max.double().clamp(min=FLOOR).pow(1 - alpha)
    return s.float()
