"""Checks of a checkpoint's tensors against what a family's config implies.

``check_tensors`` runs when an architecture is built, before anything is sized by the config:
every expected tensor is present, is a float tensor of the expected shape, and nothing in the
checkpoint is left unmapped. Values are checked where they are read: ``finite_lookup`` for the
small tensors that become graph constants (norms, scalars), the weight writers for linears and
tables (llmexport/mnn), so that a NaN or Inf never reaches an exported file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from llmexport.errors import InputError
from llmexport.source.safetensors_file import dtype_name

#: dtypes a checkpoint stores float weights in; integers, booleans and F64 are refused, not cast
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

TensorLookup = Callable[[str], torch.Tensor]
#: expected tensors: name -> shape (None: any shape)
Shapes = dict[str, "tuple[int, ...] | None"]


def check_tensors(weights: Any, expected: Mapping[str, tuple[int, ...] | None], where: Path, family: str,
                  ignored: Callable[[str], bool] = lambda name: False) -> None:
    """Every ``expected`` tensor (name -> shape, None: any shape) is present with a float dtype
    and that shape, and every tensor of the checkpoint is expected (or ``ignored``)."""
    for name, shape in expected.items():
        if name not in weights:
            raise InputError(f"{where}: tensor {name!r} missing (config implies it)")
        dtype = weights.dtype(name)
        if dtype not in FLOAT_DTYPES:
            raise InputError(f"{where}: tensor {name!r} is {dtype_name(dtype)}, expected a float tensor "
                             "(F32, F16 or BF16)")
        if shape is not None and tuple(weights.shape(name)) != tuple(shape):
            raise InputError(f"{where}: tensor {name!r} has shape {list(weights.shape(name))}, "
                             f"config implies {list(shape)}")
    unused = sorted(n for n in weights.names() if n not in expected and not ignored(n))
    if unused:
        raise InputError(f"{where}: {len(unused)} tensor(s) not mapped by the {family} exporter, e.g. {unused[0]!r}")


def check_finite(name: str, value: torch.Tensor, where: Path | str, allow_inf: bool = False) -> torch.Tensor:
    """``value`` unchanged, or an InputError naming the tensor when it holds NaN (or Inf)."""
    bad = torch.isnan(value) if allow_inf else ~torch.isfinite(value)
    if bool(bad.any()):
        kind = "NaN" if allow_inf or bool(torch.isnan(value).any()) else "Inf"
        raise InputError(f"{where}: tensor {name!r} holds {kind} values")
    return value


def finite_lookup(weights: Any, where: Path | str) -> TensorLookup:
    """``weights.tensor`` for graph constants, refusing NaN/Inf values by name."""
    return lambda name: check_finite(name, weights.tensor(name), where)


def count_limit(weights: Any) -> int:
    """An upper bound for any per-tensor count a config may claim (layers, experts): a checkpoint
    cannot have more of them than it has tensors (stacked experts are checked by shape)."""
    return max(1, len(weights.names()))


def require_stacked(weights: Any, name: str, count: int, key: str, where: Path) -> None:
    """A stacked tensor ``name`` [count, ...] must exist before ``count`` things are built from it."""
    if name not in weights:
        raise InputError(f"{where}: tensor {name!r} missing (config implies it)")
    shape = tuple(weights.shape(name))
    if not shape or shape[0] != count:
        raise InputError(f"{where}: config.json '{key}' is {count} but tensor {name!r} has shape {list(shape)}")

