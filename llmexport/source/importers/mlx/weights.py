"""An MLX checkpoint's tensors in HF names: renamed, split per expert or joined as the family's
layout says, dequantized on read, and offered with their stored integers (``Prequantized``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator

import numpy as np
import torch

from llmexport.errors import InputError
from llmexport.source.importers.mlx.format import MlxQuantConfig, stored_format, unpack_levels
from llmexport.source.safetensors_file import LazyTensor
from llmexport.spec import LazyRows, MlxLayout, Prequantized, QuantInfo, WeightStore


@dataclass(frozen=True)
class _Source:
    """One MLX tensor, or one expert of a stacked one, feeding one part of an HF tensor."""

    weight: LazyRows
    scales: LazyRows | None = None
    biases: LazyRows | None = None
    info: QuantInfo | None = None
    expert: int | None = None
    transpose: bool = False  # a float tensor: HF's last two axes are the stored ones swapped
    offset: float = 0.0  # a float tensor: HF's value is the stored one minus this

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.weight.shape[1:] if self.expert is not None else self.weight.shape)
        if self.info is not None:
            shape[-1] = shape[-1] * 32 // self.info.bits
        if self.transpose:
            shape[-2:] = shape[-1], shape[-2]
        return tuple(shape)

    def read(self, start: int, stop: int | None) -> Prequantized | torch.Tensor:
        """Rows [start, stop) along the first axis, as stored (quantized or float)."""
        def rows(lazy: LazyRows) -> torch.Tensor:
            if self.expert is None:
                return lazy.rows(start, lazy.shape[0] if stop is None else stop)
            return lazy.rows(self.expert, self.expert + 1)[0][start:stop]

        if self.info is None:
            return self._as_hf(rows(self.weight))
        assert self.scales is not None and self.biases is not None  # a quantized source has both
        levels = unpack_levels(rows(self.weight), self.info.bits)
        return Prequantized(levels, rows(self.scales), rows(self.biases), self.info.bits, self.info.group)

    def _as_hf(self, stored: torch.Tensor) -> torch.Tensor:
        """A float tensor as HF holds it: axes swapped back, the offset taken off in fp32 (exact
        for a stored ``w + 1`` in bf16/fp16, whose difference from 1 fits fp32's mantissa)."""
        if self.transpose:
            stored = stored.transpose(-1, -2).contiguous()  # rows are read along axis 0, which is never swapped
        return stored.float() - self.offset if self.offset else stored


def _dequantized(value: Prequantized | torch.Tensor) -> torch.Tensor:
    return value.dequantize() if isinstance(value, Prequantized) else value


@dataclass
class _HfTensor:
    slots: list[_Source | None] = field(default_factory=list)  # filled while the store is built

    @property
    def parts(self) -> list[_Source]:
        """The sources of the joined parts, in row order (every slot is filled once built)."""
        parts = [p for p in self.slots if p is not None]
        if len(parts) != len(self.slots):
            raise InputError("an MLX tensor joined from parts is missing one of them")
        return parts

    @property
    def shape(self) -> tuple[int, ...]:
        shapes = [p.shape for p in self.parts]
        if len(shapes) == 1:
            return shapes[0]
        return (*shapes[0][:-2], sum(s[-2] for s in shapes), shapes[0][-1])

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if any(p.info or p.offset for p in self.parts) else self.parts[0].weight.dtype

    def read(self, start: int, stop: int | None) -> Prequantized | torch.Tensor:
        """Rows [start, stop) along the first axis; parts are joined along axis -2."""
        if len(self.parts) == 1:
            return self.parts[0].read(start, stop)
        stacked = len(self.shape) > 2  # the first axis is not the joined one: slice each part
        values = [p.read(start, stop) if stacked else p.read(0, None) for p in self.parts]
        window = slice(None) if stacked else slice(start, stop)
        quantized = [v for v in values if isinstance(v, Prequantized)]
        if len(quantized) == len(values) and len({v.info for v in quantized}) == 1:
            return Prequantized.cat(quantized)[window]
        return torch.cat([_dequantized(v) for v in values], dim=-2)[window]


class MlxLazy(LazyTensor):
    """An HF-named tensor of an MLX checkpoint: ``read``/``rows``/``row_chunks``/``take`` give fp32
    values (dequantized), ``quantized_rows``/``quantized_chunks`` the stored integers of a quantized table."""

    def __init__(self, tensor: _HfTensor, name: str):
        self._tensor, self.name = tensor, name
        self.shape = torch.Size(tensor.shape)
        self.dtype = tensor.dtype

    @property
    def row_bytes(self) -> int:
        return max(1, int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize)

    def read(self) -> torch.Tensor:
        return self.rows(0, self.shape[0])

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return _dequantized(self._tensor.read(start, stop))

    @property
    def quantization(self) -> tuple[QuantInfo | None, ...]:
        return tuple(p.info for p in self._tensor.parts)

    @property
    def label(self) -> str:
        """How the table is stored, for plans and reports ("4-bit group 64")."""
        return stored_format(self.quantization)

    def quantized_rows(self, start: int, stop: int) -> Prequantized:
        """Rows [start, stop) with their stored integers (a table written as stored)."""
        value = self._tensor.read(start, stop)
        if not isinstance(value, Prequantized):
            raise ValueError(f"{self.name} is not stored quantized")
        return value

    def quantized_chunks(self, max_bytes: int = 64 << 20) -> Iterator[Prequantized]:
        step = max(1, max_bytes // self.row_bytes)
        for start in range(0, self.shape[0], step):
            yield self.quantized_rows(start, start + step)


class MlxWeights:
    """The checkpoint's tensors under their HF names (the ``WeightStore`` interface): values
    come back in fp32, dequantized; ``prequantized`` hands over the stored integers."""

    format = "mlx-affine"
    alpha_note = ("transcoded records keep MLX's integers; their alpha [zero, scale] is stored in fp32 "
                  "(zero = bias + 2^(bits-1) * scale needs more mantissa than fp16 has, and bf16 scales can "
                  "exceed fp16's range)")

    def __init__(self, raw: WeightStore, layout: MlxLayout, quant: MlxQuantConfig, where: str):
        self.where = where
        self.folder = raw.folder
        self._tensors: dict[str, _HfTensor] = {}
        names = set(raw.names())
        for name in sorted(names):
            stem, _, leaf = name.rpartition(".")
            quantized = {stem + ".weight", stem + ".scales"} <= names
            if quantized and leaf in ("scales", "biases"):
                continue  # read with their weight
            source = self._quantized_source(raw, stem, quant) if quantized and leaf == "weight" else \
                _Source(raw.lazy(name))
            self._add(name, source, layout)
        for hf, tensor in self._tensors.items():
            if any(p is None for p in tensor.slots) or len({p.shape[:-2] + p.shape[-1:] for p in tensor.parts}) > 1:
                raise InputError(f"{where}: the MLX tensors joined into {hf!r} are incomplete or disagree in shape")

    def _quantized_source(self, raw: WeightStore, base: str, quant: MlxQuantConfig) -> _Source:
        info = quant.for_module(base)
        if base + ".biases" not in raw:
            raise InputError(f"{self.where}: {base}.scales without {base}.biases (only MLX affine is supported)")
        if info is None:
            raise InputError(f"{self.where}: {base} has scales but config.json says it is not quantized")
        packed, scales = raw.shape(base + ".weight"), raw.shape(base + ".scales")
        width = packed[-1] * 32 // info.bits
        if raw.dtype(base + ".weight") != torch.uint32 or packed[-1] * 32 % info.bits \
                or tuple(scales) != (*packed[:-1], width // info.group) or raw.shape(base + ".biases") != scales:
            raise InputError(f"{self.where}: {base}: packed {list(packed)} / scales {list(scales)} do not fit "
                             f"{info} (config.json quantization)")
        return _Source(raw.lazy(base + ".weight"), raw.lazy(base + ".scales"), raw.lazy(base + ".biases"), info)

    def _add(self, mlx_name: str, source: _Source, layout: MlxLayout) -> None:
        hf, rule = layout.hf_name(mlx_name)
        index, count = rule.part if rule else (0, 1)
        if rule is not None and rule.reshapes:
            if source.info is not None or len(source.weight.shape) < (3 if rule.transpose else 1):
                raise InputError(f"{self.where}: {mlx_name}: stored {list(source.weight.shape)}"
                                 f"{' quantized' if source.info else ''} where mlx-lm's layout has a float "
                                 f"tensor{' of 3 axes' if rule.transpose else ''}")
            source = replace(source, transpose=rule.transpose, offset=rule.offset)
        experts = range(source.weight.shape[0]) if rule and rule.split else [None]
        for e in experts:
            name = hf if e is None else hf.replace("{e}", str(e))
            tensor = self._tensors.setdefault(name, _HfTensor([None] * count))
            if len(tensor.slots) != count or tensor.slots[index] is not None:
                raise InputError(f"{self.where}: more than one MLX tensor maps to {name!r}")
            tensor.slots[index] = source if e is None else _Source(source.weight, source.scales, source.biases,
                                                                   source.info, e)

    # --- the WeightStore interface -----------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def _get(self, name: str) -> _HfTensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise InputError(f"checkpoint has no tensor {name!r}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self._get(name).shape

    def dtype(self, name: str) -> torch.dtype:
        """The dtype its values come back in (fp32 for what MLX quantized)."""
        return self._get(name).dtype

    def lazy(self, name: str) -> MlxLazy:
        return MlxLazy(self._get(name), name)

    def tensor(self, name: str) -> torch.Tensor:
        return self.lazy(name).read()

    # --- the stored integers ------------------------------------------------------------------------
    def quantization(self, name: str) -> tuple[QuantInfo | None, ...]:
        """The stored format of each MLX tensor joined into ``name`` (None: stored as floats)."""
        return tuple(p.info for p in self._get(name).parts)

    def unfit(self, name: str) -> str | None:
        """None: every MLX group is a run of consecutive inputs, as an MNN block is."""
        return None

    def label(self, name: str) -> str:
        return stored_format(self.quantization(name))

    def stored(self, name: str, expert: int | None = None) -> Prequantized | torch.Tensor:
        """A tensor (or one expert of a stacked one) as stored: integers, or floats."""
        tensor = self._get(name)
        return tensor.read(0, None) if expert is None else tensor.read(expert, expert + 1)[0]

    def prequantized(self, name: str, expert: int | None = None) -> Prequantized:
        """The integers of a 2-D weight (or of one expert of a stacked 3-D one)."""
        value = self.stored(name, expert)
        if not isinstance(value, Prequantized):
            raise ValueError(f"{name} is not stored quantized in one format")
        return value
