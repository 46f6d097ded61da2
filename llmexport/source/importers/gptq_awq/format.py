"""The ``quantization_config`` of a GPTQ or AWQ checkpoint, and how its int32 words unpack
(the formats are described in ``llmexport.source.importers.gptq_awq``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmexport.errors import InputError
from llmexport.source.importers.bitstream import unpack_levels

#: the config key transformers and the quantizers write, and the methods read here
CONFIG_KEY = "quantization_config"
METHODS = ("gptq", "awq")
GPTQ_BITS = (2, 3, 4, 8)
#: GPTQ's zero points as stored: v1 keeps ``zero - 1`` (AutoGPTQ), v2 the zero itself (GPTQModel)
GPTQ_ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}
#: AutoAWQ's GEMM layout: the column of each 4-bit slot of a word, least significant slot first,
#: inverted: ``AWQ_COLUMN_SLOT[c]`` is the slot holding column ``c`` of the word's 8 columns
AWQ_COLUMN_SLOT = (0, 4, 1, 5, 2, 6, 3, 7)


@dataclass(frozen=True)
class PackedFormat:
    """How one checkpoint packs its linears: method, bits, group (-1: the whole input width) and
    what the readers need beyond them."""

    method: str
    bits: int
    group: int
    label: str  # the format in plans and reports: "gptq", "gptq_v2", "awq-gemm"
    zero_offset: int = 0

    def group_for(self, in_features: int) -> int:
        return in_features if self.group == -1 else self.group

    def levels(self, qweight: torch.Tensor) -> torch.Tensor:
        """Unsigned levels uint8 ``[out, in]`` of a linear's ``qweight``."""
        if self.method == "gptq":  # [in * bits / 32, out]: each column is one stream along the inputs
            return unpack_levels(qweight.t().contiguous(), self.bits)
        return self._awq_columns(unpack_levels(qweight, self.bits)).t().contiguous()

    def zeros(self, qzeros: torch.Tensor) -> torch.Tensor:
        """Integer zero points int16 ``[out, groups]`` of a linear's ``qzeros`` ``[groups, out * bits / 32]``
        (int16: GPTQ v1's ``zero - 1`` wraps to ``2^bits - 1`` for a zero of 0, which its kernels
        then read as ``2^bits``; the value is kept as the kernels read it)."""
        levels = unpack_levels(qzeros, self.bits)
        if self.method == "awq":
            levels = self._awq_columns(levels)
        return (levels.to(torch.int16) + self.zero_offset).t().contiguous()

    @staticmethod
    def _awq_columns(slots: torch.Tensor) -> torch.Tensor:
        """AWQ's words hold 8 columns in the order [0, 2, 4, 6, 1, 3, 5, 7]: back to column order."""
        rows, width = slots.shape
        return slots.reshape(rows, width // 8, 8)[:, :, list(AWQ_COLUMN_SLOT)].reshape(rows, width)


def packed_quantization(config: dict[str, Any]) -> dict[str, Any] | None:
    """The ``quantization_config`` of a checkpoint some HF quantizer wrote (it names a
    ``quant_method``), or None."""
    block = config.get(CONFIG_KEY)
    return block if isinstance(block, dict) and "quant_method" in block else None


def packed_format(block: dict[str, Any], where: str) -> PackedFormat:
    """The format a ``quantization_config`` describes; InputError for what is not GPTQ/AWQ as read here."""
    method = block.get("quant_method")
    if method not in METHODS:
        raise InputError(f"{where}: quantization_config.quant_method {method!r} is not supported "
                         f"(supported: {', '.join(METHODS)}, and MLX checkpoints)")
    return _gptq(block, where) if method == "gptq" else _awq(block, where)


def _int(block: dict[str, Any], keys: tuple[str, ...], where: str, default: int | None = None) -> int:
    for key in keys:
        if key in block:
            value = block[key]
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            raise InputError(f"{where}: quantization_config.{key} must be an integer, got {value!r}")
    if default is None:
        raise InputError(f"{where}: quantization_config has no {keys[0]!r}")
    return default


def _group(block: dict[str, Any], keys: tuple[str, ...], where: str) -> int:
    group = _int(block, keys, where, -1)
    if group != -1 and group <= 0:
        raise InputError(f"{where}: quantization_config.{keys[0]} {group}: expected a positive size or -1")
    return group


def _gptq(block: dict[str, Any], where: str) -> PackedFormat:
    bits = _int(block, ("bits",), where)
    if bits not in GPTQ_BITS:
        raise InputError(f"{where}: quantization_config.bits {bits}: GPTQ packs {', '.join(map(str, GPTQ_BITS))} bits")
    version = block.get("checkpoint_format", "gptq")
    if version not in GPTQ_ZERO_OFFSET:
        raise InputError(f"{where}: quantization_config.checkpoint_format {version!r} is not supported "
                         f"(supported: {', '.join(GPTQ_ZERO_OFFSET)})")
    if block.get("dynamic"):
        raise InputError(f"{where}: quantization_config.dynamic: per-module GPTQ overrides are not supported")
    pack_dtype = block.get("pack_dtype", "int32")
    if str(pack_dtype).removeprefix("torch.") != "int32":
        raise InputError(f"{where}: quantization_config.pack_dtype {pack_dtype!r} is not supported (int32 only)")
    return PackedFormat("gptq", bits, _group(block, ("group_size",), where), version, GPTQ_ZERO_OFFSET[version])


def _awq(block: dict[str, Any], where: str) -> PackedFormat:
    version = str(block.get("version", "gemm")).lower()
    if version != "gemm":
        raise InputError(f"{where}: quantization_config.version {version!r}: only AWQ's 'gemm' layout is "
                         "supported (gemv and the other kernels' layouts are not)")
    bits = _int(block, ("bits", "w_bit"), where)
    if bits != 4:
        raise InputError(f"{where}: quantization_config.bits {bits}: AWQ's gemm layout packs 4 bits only")
    if block.get("zero_point", True) is not True:
        raise InputError(f"{where}: quantization_config.zero_point {block.get('zero_point')!r}: only AWQ with "
                         "zero points is supported")
    return PackedFormat("awq", bits, _group(block, ("group_size", "q_group_size"), where), "awq-gemm")
