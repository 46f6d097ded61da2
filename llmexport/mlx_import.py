"""MLX-quantized checkpoints (mlx-lm's affine format), read so that their integers reach MNN unchanged.

The format, as mlx 0.32 / mlx-lm 0.32 write it (``mx.quantize`` mode "affine";
``mlx_lm/utils.py`` ``quantize_model`` and ``save_config``):

* ``config.json`` ``quantization`` (copied to ``quantization_config``): the default
  ``{"group_size", "bits", "mode"}`` plus one entry per module path to which the quant predicate
  gave its own parameters (a dict) or which it left unquantized (``false``). A module is quantized
  exactly when ``P.scales`` exists beside ``P.weight`` (that is how mlx-lm's loader decides).
* a quantized ``P.weight`` is uint32 ``[..., out, in * bits / 32]``; ``P.scales`` and ``P.biases``
  are ``[..., out, in / group]`` in the model dtype. Each row is one bit stream over its
  little-endian words, least significant bit first: value j holds bits ``[j*bits, (j+1)*bits)``
  (checked against ``mx.dequantize`` for 2..8 bits in tests/test_mlx_import.py).
* a value is ``scales * q + biases`` per group with unsigned ``q`` in ``0 .. 2^bits - 1``. Scales
  can be negative and biases are not the group minimum (MLX pins the group's larger-magnitude
  edge at q = 0): only the affine map is guaranteed.

MNN's asymmetric record holds the same map: stored level ``q``, ``scale = scales`` and
``zero = biases + 2^(bits-1) * scales`` (the value of the signed level 0); MNN decodes
``(q - 2^(bits-1)) * scale + zero``. With bf16/fp16 scales ``q * scale`` is exact in fp32 and so
is ``zero`` (short of scale and bias lying ~16 binades apart), so a transcoded record decodes to
exactly fp32 ``scales * q + biases``. ``zero`` needs more mantissa than fp16 has and bf16 scales
can lie outside fp16's range, so such records keep their alpha in fp32 (``scaleStorage FP32``).

Family knowledge (how mlx-lm renames and stacks a family's tensors, which config parts it drops)
comes from ``Architecture.mlx_layout``; which linears keep their integers is decided in
``llmexport.mlx_sources``.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch

from llmexport.checkpoint import Checkpoint, LazyTensor, SafetensorsIndex
from llmexport.errors import InputError
from llmexport.quant.rtn import QuantizedTensor

log = logging.getLogger(__name__)

_MLX_KEYS = ("quantization", "quantization_config")


@dataclass(frozen=True)
class QuantInfo:
    """Bits and group size of one MLX-quantized tensor."""

    bits: int
    group: int

    def __str__(self) -> str:
        return f"{self.bits}-bit group {self.group}"


def mlx_quantization(config: dict[str, Any]) -> dict[str, Any] | None:
    """The ``quantization`` block of an MLX checkpoint's config, or None for any other checkpoint
    (an HF ``quantization_config`` carries a ``quant_method``; mlx-lm's never does)."""
    for key in _MLX_KEYS:
        block = config.get(key)
        if isinstance(block, dict) and "bits" in block and "group_size" in block and "quant_method" not in block:
            return block
    return None


class MlxQuantConfig:
    """Per-module bits and group size from ``config.json`` ``quantization``."""

    def __init__(self, block: dict[str, Any], where: str):
        self.where = where
        self.default = self._info(block, None, "quantization")
        self.modules = {k: v for k, v in block.items() if isinstance(v, (dict, bool))}

    def _info(self, entry: dict[str, Any], base: QuantInfo | None, key: str) -> QuantInfo:
        mode = entry.get("mode", "affine")
        if mode != "affine":
            raise InputError(f"{self.where}: {key}: MLX quantization mode {mode!r} is not supported (affine only)")
        try:
            bits = int(entry["bits"] if "bits" in entry or base is None else base.bits)
            group = int(entry["group_size"] if "group_size" in entry or base is None else base.group)
        except (TypeError, ValueError, KeyError):
            raise InputError(f"{self.where}: {key}: bits/group_size must be integers") from None
        if not 1 <= bits <= 8 or group <= 0:
            raise InputError(f"{self.where}: {key}: {bits} bits / group {group} is not an MLX affine format")
        return QuantInfo(bits, group)

    def for_module(self, path: str) -> QuantInfo | None:
        """The module's format; None when the config says it stays unquantized."""
        entry = self.modules.get(path, True)
        if entry is False:
            return None
        if isinstance(entry, dict):
            return self._info(entry, self.default, path)
        return self.default


def unpack_levels(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """MLX uint32 words ``[..., words]`` -> unsigned levels uint8 ``[..., words * 32 // bits]``.

    ``packed`` holds the file's bytes (a safetensors read viewed as uint32), so viewing it as bytes
    gives the little-endian stream on any host."""
    raw = packed.contiguous().view(torch.uint8).numpy()
    lead = raw.shape[:-1]
    if bits == 8:
        levels = raw
    elif 8 % bits == 0:  # 2 and 4 bits: whole values per byte, the first in the low bits
        shifts = np.arange(0, 8, bits, dtype=np.uint8)
        levels = ((raw[..., None] >> shifts) & np.uint8((1 << bits) - 1)).reshape(*lead, -1)
    else:  # 3, 5, 6, 7 bits straddle bytes: regroup the little-endian bit stream
        stream = np.unpackbits(raw, axis=-1, bitorder="little")
        stream = stream.reshape(*lead, stream.shape[-1] // bits, bits)
        levels = np.packbits(stream, axis=-1, bitorder="little")[..., 0]
    return torch.from_numpy(np.ascontiguousarray(levels, dtype=np.uint8))


@dataclass(frozen=True)
class Prequantized:
    """A weight quantized by its source: ``w = scales * levels + biases`` per group of ``group``
    inputs. ``levels`` uint8 ``[..., out, in]`` in ``0 .. 2^bits - 1``; ``scales`` and ``biases``
    ``[..., out, in // group]`` in the source dtype. Indexing selects along the first axis."""

    levels: torch.Tensor
    scales: torch.Tensor
    biases: torch.Tensor
    bits: int
    group: int

    @property
    def shape(self) -> torch.Size:
        return self.levels.shape

    def dim(self) -> int:
        return self.levels.dim()

    def numel(self) -> int:
        return self.levels.numel()

    @property
    def info(self) -> QuantInfo:
        return QuantInfo(self.bits, self.group)

    def __getitem__(self, key: int | slice) -> "Prequantized":
        return Prequantized(self.levels[key], self.scales[key], self.biases[key], self.bits, self.group)

    def dequantize(self) -> torch.Tensor:
        """fp32 ``scales * q + biases``: exactly MLX's affine map evaluated in fp32."""
        *lead, cols = self.levels.shape
        grouped = self.levels.reshape(*lead, cols // self.group, self.group).float()
        values = grouped * self.scales.float().unsqueeze(-1) + self.biases.float().unsqueeze(-1)
        return values.reshape(*lead, cols)

    @staticmethod
    def cat(parts: list["Prequantized"]) -> "Prequantized":
        """Concatenate along the rows (axis -2); every part must share bits and group."""
        first = parts[0]
        if any(p.info != first.info for p in parts):
            raise ValueError(f"cannot join parts stored as {', '.join(str(p.info) for p in parts)}")
        joined = (torch.cat([getattr(p, f) for p in parts], dim=-2) for f in ("levels", "scales", "biases"))
        return Prequantized(*joined, first.bits, first.group)


def transcode(weight: Prequantized, bits: int, block: int, sym: bool = False) -> QuantizedTensor:
    """The quantizer of ``QuantMethod.STORED``: MLX's integers and affine map in MNN's convention
    (signed level ``q - 2^(bits-1)``, ``zero = biases + 2^(bits-1) * scales``), nothing rounded but
    ``zero`` to fp32 (exact for bf16/fp16 scales; counted and logged otherwise)."""
    if sym or (bits, block) != (weight.bits, weight.group) or weight.dim() != 2:
        raise ValueError(f"a {weight.info} {list(weight.shape)} weight cannot be stored as "
                         f"{'sym' if sym else 'asym'} {bits}-bit block {block}")
    half = 1 << (bits - 1)
    oc, ic = weight.shape
    q = (weight.levels.to(torch.int16) - half).to(torch.int8).reshape(oc, ic // block, block)
    scale = weight.scales.float()
    zero = weight.biases.float() + half * scale
    inexact = int((zero.double() != weight.biases.double() + half * weight.scales.double()).sum())
    if inexact:
        log.warning("%d of %d groups: zero = bias + %d * scale rounds in fp32 (decoded values may differ from "
                    "MLX's by one ulp)", inexact, zero.numel(), half)
    return QuantizedTensor(q=q, scale=scale, zero=zero, bits=bits, block=block)


# --- family layouts ---------------------------------------------------------------------------
@dataclass(frozen=True)
class MlxRule:
    """One MLX tensor name pattern and the HF tensor(s) it holds (first matching rule wins).

    ``hf``: the ``re`` replacement giving the HF name. ``split``: the MLX tensor stacks experts
    along axis 0 and ``hf`` holds ``{e}``, one HF tensor per expert. ``part``: (index, count) when
    ``count`` MLX tensors are one HF tensor joined along the rows (axis -2), in index order.
    """

    pattern: str
    hf: str
    split: bool = False
    part: tuple[int, int] = (0, 1)


@dataclass(frozen=True)
class MlxLayout:
    """How a family's mlx-lm port names tensors: renames, stacked/joined experts, and the config
    entries of parts mlx-lm drops (their tensors are absent from the MLX checkpoint)."""

    rules: tuple[MlxRule, ...] = ()
    dropped_config: tuple[str, ...] = ()

    def hf_name(self, mlx_name: str) -> tuple[str, MlxRule | None]:
        for rule in self.rules:
            if re.match(rule.pattern, mlx_name):
                return re.sub(rule.pattern, rule.hf, mlx_name), rule
        return mlx_name, None


@dataclass(frozen=True)
class _Source:
    """One MLX tensor, or one expert of a stacked one, feeding one part of an HF tensor."""

    weight: LazyTensor
    scales: LazyTensor | None = None
    biases: LazyTensor | None = None
    info: QuantInfo | None = None
    expert: int | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.weight.shape[1:] if self.expert is not None else self.weight.shape)
        if self.info is not None:
            shape[-1] = shape[-1] * 32 // self.info.bits
        return tuple(shape)

    def read(self, start: int, stop: int | None) -> Prequantized | torch.Tensor:
        """Rows [start, stop) along the first axis, as stored (quantized or float)."""
        def rows(lazy: LazyTensor) -> torch.Tensor:
            if self.expert is None:
                return lazy.rows(start, lazy.shape[0] if stop is None else stop)
            return lazy.rows(self.expert, self.expert + 1)[0][start:stop]

        if self.info is None:
            return rows(self.weight)
        levels = unpack_levels(rows(self.weight), self.info.bits)
        return Prequantized(levels, rows(self.scales), rows(self.biases), self.info.bits, self.info.group)


def _dequantized(value: Prequantized | torch.Tensor) -> torch.Tensor:
    return value.dequantize() if isinstance(value, Prequantized) else value


@dataclass
class _HfTensor:
    parts: list[_Source | None] = field(default_factory=list)

    @property
    def shape(self) -> tuple[int, ...]:
        shapes = [p.shape for p in self.parts]
        if len(shapes) == 1:
            return shapes[0]
        return (*shapes[0][:-2], sum(s[-2] for s in shapes), shapes[0][-1])

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if any(p.info for p in self.parts) else self.parts[0].weight.dtype

    def read(self, start: int, stop: int | None) -> Prequantized | torch.Tensor:
        """Rows [start, stop) along the first axis; parts are joined along axis -2."""
        if len(self.parts) == 1:
            return self.parts[0].read(start, stop)
        stacked = len(self.shape) > 2  # the first axis is not the joined one: slice each part
        values = [p.read(start, stop) if stacked else p.read(0, None) for p in self.parts]
        window = slice(None) if stacked else slice(start, stop)
        if all(isinstance(v, Prequantized) for v in values) and len({v.info for v in values}) == 1:
            return Prequantized.cat(values)[window]
        return torch.cat([_dequantized(v) for v in values], dim=-2)[window]


class MlxLazy(LazyTensor):
    """An HF-named tensor of an MLX checkpoint: ``read``/``rows``/``row_chunks``/``take`` give fp32
    values (dequantized), ``quantized_chunks`` the stored integers of a quantized table."""

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

    def quantized_chunks(self, max_bytes: int = 64 << 20) -> Iterator[Prequantized]:
        step = max(1, max_bytes // self.row_bytes)
        for start in range(0, self.shape[0], step):
            value = self._tensor.read(start, start + step)
            if not isinstance(value, Prequantized):
                raise ValueError(f"{self.name} is not stored quantized")
            yield value


class MlxWeights:
    """The checkpoint's tensors under their HF names (the ``SafetensorsIndex`` interface): values
    come back in fp32, dequantized; ``prequantized`` hands over the stored integers."""

    def __init__(self, raw: SafetensorsIndex, layout: MlxLayout, quant: MlxQuantConfig, where: str):
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
            if any(p is None for p in tensor.parts) or len({p.shape[:-2] + p.shape[-1:] for p in tensor.parts}) > 1:
                raise InputError(f"{where}: the MLX tensors joined into {hf!r} are incomplete or disagree in shape")

    def _quantized_source(self, raw: SafetensorsIndex, base: str, quant: MlxQuantConfig) -> _Source:
        info = quant.for_module(base)
        if base + ".biases" not in raw:
            raise InputError(f"{self.where}: {base}.scales without {base}.biases (only MLX affine is supported)")
        if info is None:
            raise InputError(f"{self.where}: {base} has scales but config.json says it is not quantized")
        packed, scales = raw.shape(base + ".weight"), raw.shape(base + ".scales")
        width = packed[-1] * 32 // info.bits
        if raw.entry(base + ".weight").dtype != torch.uint32 or packed[-1] * 32 % info.bits \
                or tuple(scales) != (*packed[:-1], width // info.group) or raw.shape(base + ".biases") != scales:
            raise InputError(f"{self.where}: {base}: packed {list(packed)} / scales {list(scales)} do not fit "
                             f"{info} (config.json quantization)")
        return _Source(raw.lazy(base + ".weight"), raw.lazy(base + ".scales"), raw.lazy(base + ".biases"), info)

    def _add(self, mlx_name: str, source: _Source, layout: MlxLayout) -> None:
        hf, rule = layout.hf_name(mlx_name)
        index, count = rule.part if rule else (0, 1)
        experts = range(source.weight.shape[0]) if rule and rule.split else [None]
        for e in experts:
            name = hf if e is None else hf.replace("{e}", str(e))
            tensor = self._tensors.setdefault(name, _HfTensor([None] * count))
            if len(tensor.parts) != count or tensor.parts[index] is not None:
                raise InputError(f"{self.where}: more than one MLX tensor maps to {name!r}")
            tensor.parts[index] = source if e is None else _Source(source.weight, source.scales, source.biases,
                                                                   source.info, e)

    # --- the SafetensorsIndex interface -----------------------------------------------------------
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


class MlxCheckpoint(Checkpoint):
    """An MLX checkpoint seen as the HF checkpoint it was converted from: HF tensor names,
    dequantized values, and a config without the MLX keys and the parts mlx-lm dropped."""

    def __init__(self, base: Checkpoint, layout: MlxLayout):
        where = str(base.path / "config.json")
        block = mlx_quantization(base.config)
        self.quant = MlxQuantConfig(block, where)
        self.source_config = base.config
        config = {k: v for k, v in base.config.items() if k not in _MLX_KEYS + layout.dropped_config}
        super().__init__(base.path, config, MlxWeights(base.weights, layout, self.quant, str(base.path)))

    def from_pretrained(self, loader: Any, **kwargs: Any) -> torch.nn.Module:
        """The HF model built from the config, carrying the dequantized tensors (fp32)."""
        from transformers import AutoConfig

        trust = bool(kwargs.get("trust_remote_code", False))
        config = type(AutoConfig.from_pretrained(self.path, trust_remote_code=trust)).from_dict(self.config)
        config._name_or_path = str(self.path)  # where remote code is found
        if not hasattr(loader, "from_config"):  # a concrete model class, not an Auto class
            kwargs.pop("trust_remote_code", None)
        model = (loader.from_config if hasattr(loader, "from_config") else loader._from_config)(config, **kwargs)
        self._load_into(model)
        return model

    def _load_into(self, model: torch.nn.Module) -> None:
        state = model.state_dict(keep_vars=True)
        loaded: set[int] = set()
        with torch.no_grad():
            for name in self.weights.names():
                if name not in state:
                    raise InputError(f"{self.path}: tensor {name!r} has no place in the HF model")
                state[name].copy_(self.weights.tensor(name))
                loaded.add(state[name].data_ptr())
        missing = [k for k, v in state.items() if v.data_ptr() not in loaded]
        if missing:
            raise InputError(f"{self.path}: the MLX checkpoint lacks {len(missing)} tensor(s) the HF model needs, "
                             f"e.g. {missing[0]!r}")


def adapt_checkpoint(checkpoint: Checkpoint, arch_cls: Any) -> Checkpoint:
    """``checkpoint`` itself, or its HF view when it is MLX-quantized (the family's layout)."""
    if mlx_quantization(checkpoint.config) is None:
        return checkpoint
    layout = arch_cls.mlx_layout(checkpoint.config)
    if layout is None:
        raise InputError(f"{checkpoint.path}: MLX-quantized {checkpoint.model_type!r} checkpoints are not supported "
                         "(the family declares no MLX layout)")
    return MlxCheckpoint(checkpoint, layout)
