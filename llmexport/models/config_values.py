"""Typed values out of a family's config.json: each checked, or an InputError naming file and key.

Families read every config value through these, so that a string where an integer belongs, a
boolean posing as a count, or a float the graph cannot hold (beyond fp32, NaN) fails with a
one-line message instead of surfacing as a crash in a later stage.
"""

from __future__ import annotations

import math
from typing import Any, overload

from llmexport.errors import InputError

#: the largest finite float32: graph constants are fp32, so larger config values would become inf
FP32_MAX = 3.4028234663852886e38


def int_value(cfg: dict[str, Any], key: str, where: str, default: int | None = None, minimum: int = 1,
              maximum: int | None = None) -> int:
    """An integer in [minimum, maximum] (None/absent -> ``default``, which None makes required)."""
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise InputError(f"{where}: '{key}' is missing (expected an integer)")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"{where}: '{key}' must be an integer >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise InputError(f"{where}: '{key}' is {value}, more than the {maximum} this checkpoint can hold")
    return value


@overload
def float_value(cfg: dict[str, Any], key: str, where: str, default: float, low: float = ...,
                high: float = ...) -> float: ...


@overload
def float_value(cfg: dict[str, Any], key: str, where: str, default: None, low: float = ...,
                high: float = ...) -> float | None: ...


def float_value(cfg: dict[str, Any], key: str, where: str, default: float | None, low: float = 0.0,
                high: float = FP32_MAX) -> float | None:
    """A finite number with low < value <= high (None/absent -> ``default``)."""
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low < value <= high:
        raise InputError(f"{where}: '{key}' must be a number in ({low:g}, {high:g}], got {value!r}")
    return float(value)


def flag_value(cfg: dict[str, Any], key: str, where: str, default: bool) -> bool:
    """A JSON boolean (None/absent -> ``default``)."""
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InputError(f"{where}: '{key}' must be true or false, got {value!r}")
    return value


def str_value(cfg: dict[str, Any], key: str, where: str, default: str, allowed: tuple[str, ...]) -> str:
    """One of ``allowed`` (None/absent -> ``default``)."""
    value = cfg.get(key)
    if value is None:
        return default
    if value not in allowed:
        raise InputError(f"{where}: '{key}' must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    return value
