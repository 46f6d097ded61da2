"""A GPTQ or AWQ checkpoint's tensors under HF names: ``P.qweight`` / ``qzeros`` / ``scales``
(/ ``g_idx``) read as ``P.weight``, dequantized on read, and offered with their stored integers
(``Prequantized``) where a group is a run of consecutive inputs, as an MNN block is."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from llmexport.errors import InputError
from llmexport.source.importers.gptq_awq.format import PackedFormat
from llmexport.source.importers.mlx.format import stored_format
from llmexport.source.safetensors_file import WholeLazy
from llmexport.spec import LazyRows, Prequantized, QuantInfo, WeightStore

#: the tensors of one packed linear ``P``: ``P.<leaf>``, besides its optional ``P.bias``
PACKED_LEAVES = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class _PackedLinear:
    """One quantized linear: its lazy tensors, sizes and format (shapes checked when built)."""

    stem: str
    fmt: PackedFormat
    qweight: LazyRows
    qzeros: LazyRows
    scales: LazyRows
    g_idx: LazyRows | None
    in_features: int
    out_features: int
    where: str  # the folder, for errors

    @property
    def group(self) -> int:
        return self.fmt.group_for(self.in_features)

    @functools.cached_property
    def info(self) -> QuantInfo:
        """Bits, group, and ``sym`` when every zero point is ``2^(bits-1)`` (GPTQ's ``sym``, read from
        the zeros themselves): the record then needs no zeros, half the alpha bytes."""
        zeros = self.fmt.zeros(self.qzeros.read())
        return QuantInfo(self.fmt.bits, self.group, bool((zeros == 1 << (self.fmt.bits - 1)).all()))

    @functools.cached_property
    def groups_of_inputs(self) -> torch.Tensor:
        """The group of each input (``g_idx``; without one, consecutive runs of ``group``)."""
        runs = torch.arange(self.in_features) // self.group
        if self.g_idx is None:
            return runs
        g_idx = self.g_idx.read().long()
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= self.scales.shape[0]:
            raise InputError(f"{self.where}: {self.stem}.g_idx: group indices must lie in [0, {self.scales.shape[0]})")
        return g_idx

    def unfit(self) -> str | None:
        """Why the groups are no MNN blocks, if they are not."""
        if self.in_features % self.group:
            return f"group {self.group} does not divide the input width {self.in_features}"
        if not torch.equal(self.groups_of_inputs, torch.arange(self.in_features) // self.group):
            return "act-order: g_idx places the inputs of a group apart (an MNN block is a run of consecutive inputs)"
        return None

    def prequantized(self) -> Prequantized:
        """The integers and ``w = scales * q + biases`` with ``biases = -scales * zero``: exact in fp32
        (a 16-bit scale times an integer of at most 9 bits), so both forms decode alike."""
        scales = self.scales.read().t().contiguous()
        zeros = self.fmt.zeros(self.qzeros.read())
        biases = -(scales.float() * zeros.float())
        return Prequantized(self.fmt.levels(self.qweight.read()), scales, biases, self.fmt.bits, self.group)

    def dequantize(self) -> torch.Tensor:
        """fp32 ``scale * (q - zero)`` with the scale and zero of each input's group (``g_idx``)."""
        if self.unfit() is None:
            return self.prequantized().dequantize()
        groups = self.groups_of_inputs
        scales = self.scales.read().float()[groups].t()
        zeros = self.fmt.zeros(self.qzeros.read()).float()[:, groups]
        return scales * (self.fmt.levels(self.qweight.read()).float() - zeros)


class PackedLazy(WholeLazy):
    """A packed linear's HF weight: ``read``/``rows``/``row_chunks``/``take`` give fp32 values (a
    linear is dequantized whole)."""

    def __init__(self, linear: _PackedLinear, name: str):
        self._linear, self.name = linear, name
        self.shape = torch.Size((linear.out_features, linear.in_features))

    def read(self) -> torch.Tensor:
        return self._linear.dequantize()


class PackedWeights:
    """The checkpoint's tensors under their HF names (the ``PrequantizedStore`` interface): packed
    linears come back as fp32 ``P.weight``, every other tensor as stored."""

    alpha_note = ("transcoded records keep the checkpoint's integers; their alpha [zero, scale] is stored in fp32 "
                  "(zero = scale * (2^(bits-1) - zero point) needs up to 20 significant bits, fp16 has 11)")

    def __init__(self, raw: WeightStore, fmt: PackedFormat, where: str):
        self.where, self.fmt, self.format = where, fmt, fmt.label
        self.folder = raw.folder
        names = set(raw.names())
        self._linears = {stem + ".weight": self._linear(raw, stem)
                         for stem in sorted(n.removesuffix(".qweight") for n in names if n.endswith(".qweight"))}
        packed = {f"{linear.stem}.{leaf}" for linear in self._linears.values() for leaf in PACKED_LEAVES}
        orphans = sorted(n for n in names - packed if n.rpartition(".")[2] in PACKED_LEAVES[1:])
        if orphans:
            raise InputError(f"{where}: {orphans[0]} has no {orphans[0].rpartition('.')[0]}.qweight beside it")
        clash = sorted(set(self._linears) & names)
        if clash:
            raise InputError(f"{where}: {clash[0]} is stored both as floats and packed (qweight)")
        self._raw = raw
        self._plain = sorted(names - packed)

    def _linear(self, raw: WeightStore, stem: str) -> _PackedLinear:
        fmt, bits = self.fmt, self.fmt.bits
        for leaf in ("qzeros", "scales"):
            if f"{stem}.{leaf}" not in raw:
                raise InputError(f"{self.where}: {stem}.{leaf} is missing (a {fmt.label} linear is stored as "
                                 "qweight, qzeros and scales)")
        packed = tuple(raw.shape(stem + ".qweight"))
        if len(packed) != 2 or {raw.dtype(stem + ".qweight"), raw.dtype(stem + ".qzeros")} != {torch.int32}:
            raise InputError(f"{self.where}: {stem}.qweight / qzeros must be 2-D int32 (got "
                             f"{raw.dtype(stem + '.qweight')} {list(packed)})")
        if fmt.method == "gptq":  # [in * bits / 32, out]
            in_features, out_features = packed[0] * 32 // bits, packed[1]
        else:  # AWQ: [in, out * bits / 32]
            in_features, out_features = packed[0], packed[1] * 32 // bits
        group = fmt.group_for(in_features)
        expected = {"scales": (-(-in_features // group), out_features),
                    "qzeros": (-(-in_features // group), out_features * bits // 32)}
        if (packed[0] if fmt.method == "gptq" else packed[1]) * 32 % bits or out_features * bits % 32 \
                or not in_features or not out_features:
            raise InputError(f"{self.where}: {stem}.qweight {list(packed)} does not hold whole {bits}-bit rows")
        if not raw.dtype(stem + ".scales").is_floating_point:
            raise InputError(f"{self.where}: {stem}.scales must be floating point, got {raw.dtype(stem + '.scales')}")
        for leaf, shape in expected.items():
            if tuple(raw.shape(f"{stem}.{leaf}")) != shape:
                raise InputError(f"{self.where}: {stem}.{leaf} is {list(raw.shape(f'{stem}.{leaf}'))}, expected "
                                 f"{list(shape)} for qweight {list(packed)} ({bits}-bit, group {fmt.group})")
        g_idx = raw.lazy(stem + ".g_idx") if stem + ".g_idx" in raw else None
        if g_idx is not None and tuple(g_idx.shape) != (in_features,):
            raise InputError(f"{self.where}: {stem}.g_idx is {list(g_idx.shape)}, expected [{in_features}]")
        return _PackedLinear(stem, fmt, raw.lazy(stem + ".qweight"), raw.lazy(stem + ".qzeros"),
                             raw.lazy(stem + ".scales"), g_idx, in_features, out_features, self.where)

    # --- the WeightStore interface -----------------------------------------------------------
    def names(self) -> list[str]:
        return sorted([*self._plain, *self._linears])

    def __contains__(self, name: str) -> bool:
        return name in self._linears or name in self._plain

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.lazy(name).shape)

    def dtype(self, name: str) -> torch.dtype:
        """The dtype its values come back in (fp32 for a packed linear)."""
        return self.lazy(name).dtype

    def lazy(self, name: str) -> LazyRows:
        if name in self._linears:
            return PackedLazy(self._linears[name], name)
        if name not in self._plain:
            raise InputError(f"checkpoint has no tensor {name!r}")
        return self._raw.lazy(name)

    def tensor(self, name: str) -> torch.Tensor:
        return self.lazy(name).read()

    # --- the stored integers ------------------------------------------------------------------------
    def quantization(self, name: str) -> tuple[QuantInfo | None, ...]:
        linear = self._linears.get(name)
        return (None if linear is None else linear.info,)

    def unfit(self, name: str) -> str | None:
        linear = self._linears.get(name)
        return None if linear is None else linear.unfit()

    def label(self, name: str) -> str:
        return stored_format(self.quantization(name))

    def stored(self, name: str, expert: int | None = None) -> Prequantized | torch.Tensor:
        """A packed linear's integers where its groups are blocks, else its (dequantized) values."""
        linear = self._linears.get(name)
        if linear is not None and expert is None and linear.unfit() is None:
            return linear.prequantized()
        value = self.tensor(name)
        return value if expert is None else value[expert]

    def prequantized(self, name: str, expert: int | None = None) -> Prequantized:
        value = self.stored(name, expert)
        if not isinstance(value, Prequantized):
            raise ValueError(f"{name} is not stored as integers in consecutive groups")
        return value
