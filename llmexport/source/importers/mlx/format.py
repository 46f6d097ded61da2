"""mlx-lm's quantization metadata: which modules are quantized, at which bits and group size,
and how their uint32 words unpack (the format is described in ``llmexport.source.importers.mlx``)."""

from __future__ import annotations

from typing import Any

from llmexport.errors import InputError
from llmexport.source.importers.bitstream import unpack_levels
from llmexport.spec import QuantInfo

MLX_KEYS = ("quantization", "quantization_config")
__all__ = ["MLX_KEYS", "MlxQuantConfig", "mlx_quantization", "stored_format", "unpack_levels"]


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


def stored_format(infos: tuple[QuantInfo | None, ...]) -> str:
    """How the parts of one tensor are stored, for plans and reports ("4-bit group 64", "unquantized")."""
    return " + ".join(sorted({"unquantized" if i is None else str(i) for i in infos}))
