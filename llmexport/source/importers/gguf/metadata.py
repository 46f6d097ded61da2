"""A GGUF file's key/value metadata, read with errors naming the file and key."""

from __future__ import annotations

from typing import Any

import numpy as np

from llmexport.errors import InputError


class Metadata:
    """Typed access to a GGUF file's key/value metadata, errors naming the file and key."""

    def __init__(self, fields: dict[str, Any], where: str):
        self.fields, self.where = fields, where

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def require(self, key: str, kind: type | tuple[type, ...]) -> Any:
        if key not in self.fields:
            raise InputError(f"{self.where}: metadata key {key!r} is missing")
        value = self.fields[key]
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            raise InputError(f"{self.where}: metadata key {key!r} is {value!r}, "
                             f"expected {getattr(kind, '__name__', kind)}")
        return value


def f32(value: float) -> float:
    """A float32 metadata value as the decimal HF's config had (its shortest float32 repr: 1e-06)."""
    return float(str(np.float32(value)))
