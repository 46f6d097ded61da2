"""Activation-aware scales (``--calib_method awq|smooth[+gptq]``): chosen on the model's own
activations over the calibration text, folded into the model (llmexport.calibration.folding).

HF's reference runs once over the calibration tokens (the windows of llmexport.calibration.data
joined into one sequence), its weights streamed one decoder block at a time
(llmexport.reference.streamed). Forward pre-hooks on the first linear of each of the family's
scale groups sum what the choice needs of that input: ``X^T X`` and ``sum |x|`` (AWQ), ``max |x|``
(SmoothQuant). When a block has run, its groups' scales are chosen (llmexport.quant.scales), their
folds recorded and the statistics dropped: memory holds one block and its groups' statistics,
whatever the depth. A fold is exact, so the next block's input is the same with or without it:
every group is chosen on the checkpoint's own activations.

AWQ scores each candidate by the group's output error with its weights rounded to nearest on the
export's bits and block (RTN, even where the scheme's method is HQQ: the search rounds each
linear twenty times; the records then use the scheme's method on the scaled weights).
Groups are left alone (``ScaledGroups.skipped``, with the reason) where the fold would not be
exact (llmexport.calibration.folding.fold_refusal), where no linear of the group is quantized, where the
reference holds a linear elsewhere than one ``nn.Linear``, or where no calibration token reached it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
from torch import nn

from llmexport.calibration.data import calibration_windows, read_texts
from llmexport.calibration.folding import (
    FoldedWeights,
    expansion,
    fold,
    fold_refusal,
    folded_architecture,
    tensor_readers,
)
from llmexport.models.base import Architecture
from llmexport.options import Calibration
from llmexport.quant.scales import Rounded, awq_scales, smooth_scales
from llmexport.quant.scheme import QuantMethod, QuantScheme
from llmexport.reference.streamed import ReferenceLayout, mapped_blocks, streamed_reference
from llmexport.source.checkpoint import CheckpointTensors
from llmexport.spec import LinearSpec, Quantizer, ScaleGroup

log = logging.getLogger(__name__)


@dataclass
class ScaledGroups:
    """What the scaling produced: the folded weights and architecture, the groups left alone."""

    weights: FoldedWeights
    arch: Architecture
    method: str
    folded: dict[str, float] = field(default_factory=dict)  # group -> AWQ's loss / RTN's (1.0 for smooth)
    skipped: dict[str, str] = field(default_factory=dict)
    tokens: int = 0

    def summary(self) -> str:
        ratios = sorted(self.folded.values())
        median = f" (median output error {ratios[len(ratios) // 2]:.2f}x unscaled)" if self.method == "awq" and ratios \
            else ""
        return (f"{len(self.folded)} group(s) {self.method}-scaled on {self.tokens} tokens{median}, "
                f"{len(self.skipped)} left alone")


@dataclass
class _Stats:
    """One group's input over the calibration tokens (fp64 sums)."""

    hessian: torch.Tensor | None = None
    abs_sum: torch.Tensor | None = None
    abs_max: torch.Tensor | None = None
    count: int = 0

    def add(self, x: torch.Tensor, with_hessian: bool) -> None:
        flat = x.detach().reshape(-1, x.shape[-1]).double()
        a = flat.abs()
        self.count += flat.shape[0]
        self.abs_sum = a.sum(0) if self.abs_sum is None else self.abs_sum + a.sum(0)
        self.abs_max = a.amax(0) if self.abs_max is None else torch.maximum(self.abs_max, a.amax(0))
        if with_hessian:
            h = flat.T @ flat
            self.hessian = h if self.hessian is None else self.hessian + h


def label(group: ScaleGroup) -> str:
    """How a group is named in logs: the op its scales fold into."""
    return group.norm or f"{group.producer} (output)"


def scale_and_fold(arch: Architecture, calibration: Calibration, scheme_of: Callable[[LinearSpec], QuantScheme],
                   quantizers: Mapping[QuantMethod, Quantizer], trust_remote_code: bool = False) -> ScaledGroups:
    """The folded model (module docstring)."""
    from transformers import AutoTokenizer

    method = calibration.method.scaling
    assert method is not None, "scale_and_fold without a scaling method"
    tokenizer = AutoTokenizer.from_pretrained(arch.checkpoint.path)
    ids = calibration_windows(tokenizer, read_texts(calibration.data), calibration).reshape(-1)
    weights = FoldedWeights(arch.checkpoint.weights)
    out = ScaledGroups(weights, arch, method, tokens=int(ids.numel()))
    specs = {spec.name: spec for spec in arch.linears()}
    model = streamed_reference(arch, CheckpointTensors(arch.checkpoint.weights), trust_remote_code)
    groups = _targets(arch, model, specs, scheme_of, out)
    stats = {name: _Stats() for name in groups}
    for name, (group, module) in groups.items():
        model.get_submodule(module).register_forward_pre_hook(
            lambda _, inputs, s=stats[name]: s.add(inputs[0], method == "awq"))
    layout = ReferenceLayout.of(model)
    for block in layout.blocks:
        inside = {name: group for name, (group, module) in groups.items() if layout.block_of(module) == block}
        if inside:
            model.get_submodule(block).register_forward_hook(
                lambda *_, inside=inside: _choose(arch, inside, stats, specs, scheme_of, quantizers, calibration, out))
    with mapped_blocks(), torch.no_grad():
        arch.reference_logits(model, ids, first=int(ids.numel()) - 1)
    for name in groups:
        if name not in out.folded and name not in out.skipped:
            out.skipped[name] = "outside the decoder blocks"
    for name, reason in out.skipped.items():
        log.debug("scaling: %s left alone (%s)", name, reason)
    out.arch = folded_architecture(arch, weights)
    # a family that declares no groups (Phi-3, K2-Horizon) or refuses them all is exported as without scales
    (log.info if out.folded else log.warning)("scaling: %s", out.summary())
    return out


def _targets(arch: Architecture, model: nn.Module, specs: dict[str, LinearSpec],
             scheme_of: Callable[[LinearSpec], QuantScheme], out: ScaledGroups) -> dict[str, tuple[ScaleGroup, str]]:
    """Group label -> the group and the reference module whose input it scales; the rest go to
    ``out.skipped``."""
    readers, folded_norms = tensor_readers(arch), set[str]()
    linears = {name for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    targets: dict[str, tuple[ScaleGroup, str]] = {}
    for group in arch.scale_groups():
        reason = fold_refusal(arch, group, readers, folded_norms)
        module = "" if reason else arch.reference_slot(arch.linear_source(group.linears[0]).weight)[0]
        module = module.removesuffix(".weight")
        if reason is None and all(scheme_of(specs[name]).is_fp16 for name in group.linears):
            reason = "no linear of it is quantized"
        if reason is None and module not in linears:
            reason = "not one nn.Linear of the reference"
        if reason is None:
            targets[label(group)] = (group, module)
            folded_norms.update({group.norm} if group.norm else set())
        else:
            out.skipped[label(group)] = reason
    return targets


def _choose(arch: Architecture, groups: dict[str, ScaleGroup], stats: dict[str, _Stats], specs: dict[str, LinearSpec],
            scheme_of: Callable[[LinearSpec], QuantScheme], quantizers: Mapping[QuantMethod, Quantizer],
            calibration: Calibration, out: ScaledGroups) -> None:
    """A block has run: choose and fold its groups' scales, drop their statistics."""
    for name, group in groups.items():
        s = stats.pop(name)
        if s.count == 0 or s.abs_sum is None or s.abs_max is None:
            out.skipped[name] = "not reached by the calibration tokens"
            continue
        channels = specs[group.producer].out_features if group.producer else specs[group.linears[0]].in_features
        expand = expansion(group, channels)
        weights = {n: arch.linear_weight(n)[0].float() for n in group.linears}
        if out.method == "awq":
            assert s.hessian is not None
            rounded = [Rounded(weights[n], scheme.bits, scheme.block_for(specs[n].in_features), scheme.sym)
                       for n in group.linears for scheme in [scheme_of(specs[n])] if not scheme.is_fp16]
            choice = awq_scales(rounded, s.hessian, _reduce(s.abs_sum / s.count, expand, channels, "mean"),
                                quantizers[QuantMethod.RTN], expand)
            scales, ratio = choice.scales, choice.loss / choice.base_loss if choice.base_loss > 0 else 1.0
        else:
            w_max = torch.stack([w.abs().amax(0) for w in weights.values()]).amax(0)
            scales = smooth_scales(_reduce(s.abs_max, expand, channels, "amax"),
                                   _reduce(w_max.double(), expand, channels, "amax"), calibration.smooth_alpha)
            ratio = 1.0
        fold(arch, out.weights, group, scales)
        out.folded[name] = ratio


def _reduce(values: torch.Tensor, expand: torch.Tensor | None, channels: int, how: str) -> torch.Tensor:
    """Per-input-channel ``values`` gathered onto the ``channels`` scaled channels they read
    (``how``: "mean" or "amax" over the input channels sharing one)."""
    if expand is None:
        return values
    return torch.zeros(channels, dtype=values.dtype).scatter_reduce(0, expand, values, how, include_self=False)

