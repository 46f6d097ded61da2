"""Registry of architecture families, keyed by config.json ``model_type``."""

from __future__ import annotations

import importlib
from typing import Callable

from llmexport.checkpoint import Checkpoint
from llmexport.errors import InputError
from llmexport.models.base import Architecture

_REGISTRY: dict[str, type[Architecture]] = {}
# Family modules are imported on first use so that `llmexport --help` stays fast.
_FAMILY_MODULES = ("llmexport.models.gemma4", "llmexport.models.k2_horizon", "llmexport.models.llama",
                   "llmexport.models.qwen3")


def register(*model_types: str) -> Callable[[type[Architecture]], type[Architecture]]:
    def wrap(cls: type[Architecture]) -> type[Architecture]:
        for model_type in model_types:
            if model_type in _REGISTRY:
                raise RuntimeError(f"model_type {model_type!r} registered twice")
            _REGISTRY[model_type] = cls
        cls.model_types = tuple(model_types)
        return cls

    return wrap


def _load_families() -> None:
    for module in _FAMILY_MODULES:
        importlib.import_module(module)


def supported_model_types() -> list[str]:
    _load_families()
    return sorted(_REGISTRY)


def registered_families() -> dict[str, type[Architecture]]:
    """``model_type`` -> the Architecture class registered for it."""
    _load_families()
    return dict(_REGISTRY)


def architecture_class(checkpoint: Checkpoint) -> type[Architecture]:
    """The family registered for an opened checkpoint's ``model_type``; unknown types fail loudly."""
    _load_families()
    cls = _REGISTRY.get(checkpoint.model_type)
    if cls is None:
        raise InputError(
            f"{checkpoint.path / 'config.json'}: unsupported model_type {checkpoint.model_type!r} "
            f"(supported: {', '.join(supported_model_types())})"
        )
    return cls

