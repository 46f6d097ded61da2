"""Every registered family has a tiny builder and is run by every stage's parametrized tests.

Adding a family to ``llmexport.models.FAMILIES`` (the one registry, ``model_type -> "module:Class"``)
without a builder in ``llmexport.tiny.registry`` or without a place in the rewrite, ONNX and MNN
parity tests (tests/families.py) fails here.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from llmexport import models
from llmexport.models import registered_families
from llmexport.models.base import Architecture
from llmexport.source.checkpoint import Checkpoint
from llmexport.source.loading import open_architecture
from llmexport.tiny.registry import TINY_BUILDERS

import families


def _missing(registry: dict[str, type], builders, coverage: dict[str, set[str]]) -> list[str]:
    """What the registry lacks: model types without a builder, families without stage tests."""
    problems = [f"no tiny builder for {t!r}" for t in sorted(set(registry) - set(builders))]
    for stage in families.STAGES:
        covered = {registry[t] for t in coverage.get(stage, ()) if t in registry}
        problems += [f"{cls.__name__} has no {stage} tests"
                     for cls in sorted(set(registry.values()) - covered, key=lambda c: c.__name__)]
    return problems


def test_every_family_has_a_builder_and_every_stage_test():
    for module in families.STAGE_MODULES:
        importlib.import_module(module)
    registry = registered_families()
    assert set(TINY_BUILDERS) <= set(registry)  # no builder for a family that does not exist
    assert _missing(registry, TINY_BUILDERS, families.COVERAGE) == []


def test_the_check_sees_a_family_added_without_tests():
    """Not vacuous: a newly registered family without builder and tests is reported."""
    class Newcomer(Architecture):  # never instantiated
        pass

    for module in families.STAGE_MODULES:
        importlib.import_module(module)
    registry = {**registered_families(), "newcomer": Newcomer}
    assert _missing(registry, TINY_BUILDERS, families.COVERAGE) == [
        "no tiny builder for 'newcomer'", "Newcomer has no rewrite tests", "Newcomer has no onnx tests",
        "Newcomer has no mnn tests", "Newcomer has no arm tests"]


@pytest.mark.parametrize("model_type", sorted(TINY_BUILDERS))
def test_tiny_builders_build_their_model_type(tmp_path, model_type):
    checkpoint = Checkpoint.open(TINY_BUILDERS[model_type](tmp_path / model_type, 0))
    assert checkpoint.model_type == model_type
    assert type(open_architecture(checkpoint)) is registered_families()[model_type]


def test_every_registry_entry_is_an_architecture(monkeypatch):
    assert all(issubclass(cls, Architecture) for cls in registered_families().values())
    monkeypatch.setitem(models.FAMILIES, "newcomer", "llmexport.models.base:Tower")
    with pytest.raises(TypeError, match="newcomer"):
        registered_families()


def test_listing_the_registry_imports_no_family():
    """``supported_model_types`` (the CLI's error messages and help) reads the table only."""
    code = ("import sys; from llmexport.models import FAMILIES, supported_model_types; supported_model_types(); "
            "print(sorted({v.partition(':')[0] for v in FAMILIES.values()} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
