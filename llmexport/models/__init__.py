"""Registry of architecture families, keyed by config.json ``model_type``, in one table.

``FAMILIES`` is the one place a family is registered: ``model_type -> "module:Class"``. A
family's module is imported when a checkpoint of its type is opened (or the registry is listed),
so that `llmexport --help` stays fast.
"""

from __future__ import annotations

import importlib

from llmexport.errors import InputError
from llmexport.models.base import Architecture
from llmexport.source.checkpoint import Checkpoint

#: config.json ``model_type`` -> the family's class, as "module:Class"
FAMILIES: dict[str, str] = {
    "gemma3": "llmexport.models.gemma3:Gemma3",
    "gemma3_text": "llmexport.models.gemma3:Gemma3",
    "gemma4": "llmexport.models.gemma4.family:Gemma4",
    "gemma4_text": "llmexport.models.gemma4.family:Gemma4",
    "k2_horizon": "llmexport.models.k2_horizon.family:K2Horizon",
    "lfm2": "llmexport.models.lfm2.family:Lfm2",
    "lfm2_moe": "llmexport.models.lfm2.family:Lfm2Moe",
    "llama": "llmexport.models.llama:Llama",
    "ministral": "llmexport.models.ministral:Ministral",
    "mistral": "llmexport.models.mistral:Mistral",
    "qwen2": "llmexport.models.qwen2:Qwen2",
    "phi3": "llmexport.models.phi3:Phi3",
    "qwen3": "llmexport.models.qwen3:Qwen3",
    "qwen3_moe": "llmexport.models.qwen3:Qwen3Moe",
    "qwen3_5": "llmexport.models.qwen3_5.family:Qwen3_5",
    "qwen3_5_moe": "llmexport.models.qwen3_5.family:Qwen3_5Moe",
    "qwen3_5_moe_text": "llmexport.models.qwen3_5.family:Qwen3_5MoeText",
    "qwen3_5_text": "llmexport.models.qwen3_5.family:Qwen3_5Text",
    "qwen3_vl": "llmexport.models.qwen3_vl.family:Qwen3VL",
    "qwen3_vl_moe": "llmexport.models.qwen3_vl.moe:Qwen3VLMoe",
    "smollm3": "llmexport.models.smollm3:SmolLM3",
}


def _family(model_type: str) -> type[Architecture]:
    module, _, name = FAMILIES[model_type].partition(":")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, Architecture)):
        raise TypeError(f"models.FAMILIES[{model_type!r}] = {FAMILIES[model_type]!r} is not an Architecture")
    return cls


def supported_model_types() -> list[str]:
    return sorted(FAMILIES)


def registered_families() -> dict[str, type[Architecture]]:
    """``model_type`` -> the Architecture class registered for it (every family module imported)."""
    return {model_type: _family(model_type) for model_type in FAMILIES}


def architecture_class(checkpoint: Checkpoint) -> type[Architecture]:
    """The family registered for an opened checkpoint's ``model_type``; unknown types fail loudly."""
    if checkpoint.model_type not in FAMILIES:
        raise InputError(
            f"{checkpoint.path / 'config.json'}: unsupported model_type {checkpoint.model_type!r} "
            f"(supported: {', '.join(supported_model_types())})"
        )
    return _family(checkpoint.model_type)
