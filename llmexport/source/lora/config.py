"""A PEFT LoRA adapter's ``adapter_config.json``: what the merge needs of it, and a refusal of
every setting whose merge would not be ``W + scale * B @ A``.

Facts from PEFT 0.21 (``peft/tuners/lora/config.py``, ``layer.py``, ``utils/other.py``):
``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``); ``rank_pattern`` and
``alpha_pattern`` map a regular expression to a module's own ``r`` / ``lora_alpha``, the first key
(in the file's order) that matches the end of the module's path after a dot (``get_pattern_key``:
``(.*\\.)?(key)$``) wins. ``target_modules`` and ``layers_to_transform`` only chose where the
trained factors are; the adapter's tensors say that again, so the merge reads the tensors.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from llmexport.errors import InputError
from llmexport.source.input_files import read_json

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: adapter_config.json is a few kB; PEFT writes nothing larger
_CONFIG_LIMIT = 1 << 20

#: settings whose merge is not ``W + scale * B @ A`` (or that change the model elsewhere): the value
#: PEFT's default has, which is the only one accepted
_UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "use_dora": False,  # DoRA rescales each column by a trained magnitude
    "lora_bias": False,  # a trained bias on lora_B
    "fan_in_fan_out": False,  # GPT-2's Conv1D [in, out] weights; every family here stores [out, in]
    "layer_replication": None,  # duplicates decoder layers
    "target_parameters": None,  # LoRA on bare parameters (stacked experts)
    "trainable_token_indices": None,  # a few trained rows of the token table, stored apart
    "use_qalora": False,
    "alora_invocation_tokens": None,  # activated LoRA: the delta applies after an invocation only
}


@dataclass(frozen=True)
class LoraConfig:
    """The merge's view of adapter_config.json."""

    where: str
    r: int
    alpha: float
    use_rslora: bool = False
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)
    bias: str = "none"
    modules_to_save: tuple[str, ...] = ()
    base_model: str | None = None

    @classmethod
    def read(cls, folder: Path) -> LoraConfig:
        path = folder / CONFIG_FILE
        raw = read_json(path, _CONFIG_LIMIT, "adapter config")
        where = str(path)
        peft_type = raw.get("peft_type")
        if peft_type != "LORA":
            raise InputError(f"{where}: peft_type {peft_type!r} is not supported (LORA only: LoHa, LoKr, IA3 and "
                             "the other PEFT methods merge differently)")
        for key, default in _UNSUPPORTED_DEFAULTS.items():
            value = raw.get(key, default)
            if value != default and value not in ([], {}, ()):
                raise InputError(f"{where}: {key} = {value!r} is not supported (only {default!r}: a plain LoRA "
                                 "merges as W + scale * B @ A)")
        ranks = {k: _positive_int(v, f"rank_pattern[{k!r}]", where) for k, v in _patterns(raw, "rank_pattern", where)}
        alphas = {k: _number(v, f"alpha_pattern[{k!r}]", where) for k, v in _patterns(raw, "alpha_pattern", where)}
        base_model = raw.get("base_model_name_or_path")
        return cls(where, _positive_int(raw.get("r"), "r", where), _number(raw.get("lora_alpha"), "lora_alpha", where),
                   _flag(raw, "use_rslora", where), ranks, alphas, _bias(raw, where),
                   tuple(raw.get("modules_to_save") or ()), base_model if isinstance(base_model, str) else None)

    def rank_alpha(self, module: str) -> tuple[int, float]:
        """``module``'s own rank and alpha (``rank_pattern`` / ``alpha_pattern``, else the defaults)."""
        return (_pattern_value(self.rank_pattern, module, self.r),
                _pattern_value(self.alpha_pattern, module, self.alpha))

    def scale(self, module: str) -> float:
        """The factor of ``B @ A`` in ``module``'s merge."""
        r, alpha = self.rank_alpha(module)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _positive_int(value: Any, key: str, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def _number(value: Any, key: str, where: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise InputError(f"{where}: {key} must be a positive number, got {value!r}")
    return float(value)


def _flag(raw: dict[str, Any], key: str, where: str) -> bool:
    value = raw.get(key, False)
    if not isinstance(value, bool):
        raise InputError(f"{where}: {key} must be true or false, got {value!r}")
    return value


def _patterns(raw: dict[str, Any], key: str, where: str) -> list[tuple[str, Any]]:
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise InputError(f"{where}: {key} must map module patterns to numbers")
    for pattern in value:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise InputError(f"{where}: {key}: {pattern!r} is not a regular expression ({exc})") from None
    return list(value.items())


def _bias(raw: dict[str, Any], where: str) -> str:
    """"none", or "all" / "lora_only": the adapter then carries trained biases, which replace the
    checkpoint's (as any full tensor it carries does)."""
    value = raw.get("bias", "none")
    if value not in ("none", "all", "lora_only"):
        raise InputError(f"{where}: bias = {value!r} is not one of 'none', 'all', 'lora_only'")
    return str(value)
