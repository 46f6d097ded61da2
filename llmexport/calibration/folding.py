"""Folding per-channel scales into the op before a group of linears: the model, rewritten exactly.

A family declares its ``ScaleGroup``s (``Architecture.scale_groups``): linears that read one input,
and the norm or linear whose output that input is. Given scales ``s`` for a group, the linears'
weights become ``W diag(s)`` and the op before divides its output by ``s``: a norm's weight
``w`` becomes ``w / s`` (``x * w`` norms) or ``(1 + w) / s - 1`` (Gemma's ``x * (1 + w)``); a
producing linear's rows and bias are divided by ``s`` (v_proj before o_proj, up_proj before
down_proj, where its output reaches the group channel for channel). In exact arithmetic the model
computes the same function; what changes is what rounding the linears does (llmexport.quant.scales).

The rewrite is a ``WeightStore`` over the checkpoint's (``FoldedWeights``): the folded norms are
held (they are small), the linears' weights are multiplied as they are read, so memory stays one
tensor at a time. ``folded_architecture`` opens the family again over it: the graph's constants
(norm weights are traced constants read from the store), the streamed linears and the HF reference
of a later GPTQ calibration all see the folded model. The folded norms are also saved with the
export (``FoldedWeights.norms``), where verification's stored-weights reference reads them.

A group is left alone, with the reason, when the fold would not be exact or not only touch the
group (``fold_refusal``): the family says why (``ScaleGroup.skip``), a linear of it is a row of
stacked experts, a tensor it would rescale is read by a linear outside the group, or a norm is
folded twice.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from llmexport.models.base import Architecture
from llmexport.source.safetensors_file import LazyTensor
from llmexport.spec import LazyRows, NormFormula, ScaleGroup, WeightStore


def expansion(group: ScaleGroup, channels: int) -> torch.Tensor | None:
    """For each input channel of ``group``'s linears, which of the ``channels`` scaled channels it
    reads: o_proj's channel ``h * head_dim + d`` reads v's ``(h // heads_per_kv) * head_dim + d``
    (None: one to one)."""
    if group.heads_per_kv == 1:
        return None
    heads = channels // group.head_dim * group.heads_per_kv
    head = torch.arange(heads).repeat_interleave(group.head_dim) // group.heads_per_kv
    return head * group.head_dim + torch.arange(group.head_dim).repeat(heads)


def fold_refusal(arch: Architecture, group: ScaleGroup, readers: dict[str, set[str]],
                 folded_norms: set[str]) -> str | None:
    """Why ``group`` cannot be folded exactly (None: it can). ``readers``: checkpoint tensor ->
    the linears that read it (``tensor_readers``); ``folded_norms``: norms already folded."""
    if group.skip:
        return group.skip
    if not group.linears:
        return "no linear reads it"
    names = set(group.linears) | ({group.producer} if group.producer else set())
    sources = {name: arch.linear_source(name) for name in names}
    if any(source.expert is not None for source in sources.values()):
        return "a linear of it is a row of stacked experts"
    for name, source in sources.items():
        others = readers.get(source.weight, set()) - ({name} if name == group.producer else set(group.linears))
        if others:
            return f"{source.weight} is also read by {sorted(others)[0]}"
    if group.norm is not None and group.norm in folded_norms:
        return f"{group.norm} feeds another group too"
    return None


def tensor_readers(arch: Architecture) -> dict[str, set[str]]:
    """Checkpoint tensor -> the linears that read it (a tied lm_head reads the embedding)."""
    readers: dict[str, set[str]] = {}
    for spec in arch.linears():
        source = arch.linear_source(spec.name)
        for tensor in (source.weight, source.bias):
            if tensor:
                readers.setdefault(tensor, set()).add(spec.name)
    return readers


def folded_norm(weight: torch.Tensor, scales: torch.Tensor, formula: NormFormula) -> torch.Tensor:
    """The norm weight whose output is the old one's divided by ``scales`` (fp32)."""
    w = weight.float()
    return w / scales if formula is NormFormula.SCALE else (1.0 + w) / scales - 1.0


class ScaledLazy(LazyTensor):
    """A tensor of the base store, multiplied by per-axis factors as it is read (fp32)."""

    def __init__(self, base: LazyRows, factors: Sequence[tuple[int, torch.Tensor]]):
        self.base, self.factors, self.name = base, tuple(factors), base.name
        self.shape = base.shape
        self.dtype = torch.float32

    @property
    def row_bytes(self) -> int:
        return max(1, self.shape[1:].numel() * 4)

    def _scaled(self, value: torch.Tensor) -> torch.Tensor:
        out = value.float()
        for axis, factor in self.factors:
            shape = [1] * out.dim()
            shape[axis] = factor.numel()
            out = out * factor.view(shape)
        return out

    def read(self) -> torch.Tensor:
        return self._scaled(self.base.read())

    def rows(self, start: int, stop: int) -> torch.Tensor:
        if len(self.shape) == 1:  # a bias: its one axis is the scaled one
            return self.read()[start:stop]
        return self._scaled(self.base.rows(start, stop))


class FoldedWeights:
    """A ``WeightStore``: ``base`` with folded norms replaced and scaled linears rescaled on read."""

    def __init__(self, base: WeightStore):
        self.base, self.folder = base, base.folder
        self.norms: dict[str, torch.Tensor] = {}
        self.factors: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def scale(self, tensor: str, axis: int, factor: torch.Tensor) -> None:
        self.factors.setdefault(tensor, []).append((axis, factor.float()))

    def names(self) -> list[str]:
        return self.base.names()

    def __contains__(self, name: str) -> bool:
        return name in self.base

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.base.shape(name))

    def dtype(self, name: str) -> torch.dtype:
        return torch.float32 if name in self.norms or name in self.factors else self.base.dtype(name)

    def lazy(self, name: str) -> LazyRows:
        if name in self.factors:
            return ScaledLazy(self.base.lazy(name), self.factors[name])
        return self.base.lazy(name)

    def tensor(self, name: str) -> torch.Tensor:
        if name in self.norms:
            return self.norms[name].clone()
        return self.lazy(name).read() if name in self.factors else self.base.tensor(name)


def fold(arch: Architecture, weights: FoldedWeights, group: ScaleGroup, scales: torch.Tensor) -> None:
    """Record ``group``'s fold of ``scales`` (one per channel of the op before it) in ``weights``."""
    expand = expansion(group, scales.numel())
    columns = scales if expand is None else scales[expand]
    for name in group.linears:
        weights.scale(arch.linear_source(name).weight, -1, columns)
    if group.norm is not None:
        weights.norms[group.norm] = folded_norm(weights.base.tensor(group.norm), scales, group.formula)
    if group.producer is not None:
        source = arch.linear_source(group.producer)
        weights.scale(source.weight, -2, 1.0 / scales)
        if source.bias:
            weights.scale(source.bias, -1, 1.0 / scales)


def folded_architecture(arch: Architecture, weights: FoldedWeights) -> Architecture:
    """``arch``'s family opened again over the folded weights (its graph, linears and reference read them)."""
    return type(arch)(dataclasses.replace(arch.checkpoint, weights=weights))
