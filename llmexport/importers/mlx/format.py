"""mlx-lm's quantization metadata: which modules are quantized, at which bits and group size,
and how their uint32 words unpack (the format is described in ``llmexport.importers.mlx``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from llmexport.errors import InputError
from llmexport.spec import QuantInfo

MLX_KEYS = ("quantization", "quantization_config")


def mlx_quantization(config: dict[str, Any]) -> dict[str, Any] | None:
    """The ``quantization`` block of an MLX checkpoint's config, or None for any other checkpoint
    (an HF ``quantization_config`` carries a ``quant_method``; mlx-lm's never does)."""
    for key in MLX_KEYS:
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


def stored_format(infos: tuple[QuantInfo | None, ...]) -> str:
    """How the parts of one tensor are stored, for plans and reports ("4-bit group 64", "unquantized")."""
    return " + ".join(sorted({"unquantized" if i is None else str(i) for i in infos}))
