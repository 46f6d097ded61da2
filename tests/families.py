"""Which registered families each stage's parametrized tests run (tests/test_family_registry.py).

A stage test parametrizes through ``parametrize(stage, argname, values, model_type)``, which also
records the model types it covers; ``model_type`` names the checkpoints the test builds from
each value (a string, or a function of the value). The registry test imports the stage modules
and fails when a registered family is missing from a stage.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import pytest

STAGES = ("rewrite", "onnx", "mnn", "arm")
#: stage -> model types its parametrized tests build
COVERAGE: dict[str, set[str]] = defaultdict(set)
#: the test modules that parametrize through this module
STAGE_MODULES = ("test_rewrite_parity", "test_onnx_parity", "test_export_mnn", "test_k2_horizon_parity",
                 "test_k2_horizon_mnn", "test_decoder_families", "test_decoder_families_mnn", "test_gemma3",
                 "test_gemma3_mnn", "test_phi3", "test_phi3_mnn", "test_lfm2", "test_lfm2_mnn",
                 "test_qwen3_5", "test_qwen3_5_mnn", "test_arm_runtime", "test_gemma3_vision", "test_gemma3_vision_mnn",
                 "test_qwen3_vl", "test_qwen3_vl_mnn")


def parametrize(stage: str, argname: str, values, model_type: str | Callable[[Any], str]):
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}")
    values = list(values)
    COVERAGE[stage].update(model_type(v) if callable(model_type) else model_type for v in values)
    return pytest.mark.parametrize(argname, values)
