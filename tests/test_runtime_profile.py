"""Runtime profiles: what config.json holds for each, how verification judges each, and that a
wrong graph still fails under the fast profile, whose own kernel noise would hide it."""

from __future__ import annotations

import json

import pytest

from llmexport import ExportOptions, export
from llmexport.errors import UsageError
from llmexport.mnn.config import PROFILE_KEYS, Precision, RuntimeProfile, profile_of, runtime_config
from llmexport.quant.scheme import QuantScheme
from llmexport.results import Bounds, LogitStats, StepStats, TokenizerCheck, VerifyReport
from llmexport.verification.verify import (
    FAST_MAX_ABS_ERR,
    FAST_MEAN_ABS_ERR,
    FP16_MAX_ABS_ERR,
    QUANT_MAX_ABS_ERR,
    bounds_for_export,
    judge,
    summary_line,
    verify_export,
)

FAST, EXACT = RuntimeProfile.FAST, RuntimeProfile.EXACT


@pytest.mark.parametrize("profile, memory", [(FAST, "low"), (EXACT, "normal")])
@pytest.mark.parametrize("family", [{}, {"precision": "normal"}, {"precision": "normal", "memory": "high"}])
def test_config_json_holds_the_profile_and_the_family_precision(profile, memory, family):
    config = runtime_config(family, 4, None, profile)
    assert config["memory"] == memory  # the profile is the user's choice: it wins over the family
    assert config["precision"] == family.get("precision", "low")
    assert profile_of(config) is profile


@pytest.mark.parametrize("memory", ["normal", "high", None])
def test_any_memory_mode_but_low_dequantizes_at_load(memory):
    assert profile_of({} if memory is None else {"memory": memory}) is EXACT
    assert profile_of(dict(PROFILE_KEYS[FAST])) is FAST


def test_profile_option_default_cli_value_and_validation():
    from llmexport.cli import export_options, parse_command

    assert ExportOptions().runtime_profile is FAST
    args = ["--path", "x", "--dst_path", "y"]
    assert export_options(parse_command(args)).runtime_profile is FAST
    assert export_options(parse_command([*args, "--runtime_profile", "exact"])).runtime_profile is EXACT
    with pytest.raises(UsageError, match="--runtime_profile"):
        ExportOptions(runtime_profile="fast").validate()  # a plain string, not the enum


def test_cli_rejects_an_unknown_profile(tiny_gemma4, tmp_path):
    from click.testing import CliRunner

    from llmexport.cli import main

    result = CliRunner().invoke(main, ["--path", str(tiny_gemma4("31b")), "--dst_path", str(tmp_path / "o"),
                                       "--runtime_profile", "turbo"])
    assert result.exit_code == 2 and "--runtime_profile" in result.output and not (tmp_path / "o").exists()


@pytest.mark.parametrize("bits, profile, expected", [
    ({16}, FAST, Bounds("fast", FP16_MAX_ABS_ERR)),
    ({16}, EXACT, Bounds("exact", FP16_MAX_ABS_ERR)),
    ({4, 16}, EXACT, Bounds("exact", QUANT_MAX_ABS_ERR)),
    ({4, 8}, FAST, Bounds("fast", FAST_MAX_ABS_ERR, FAST_MEAN_ABS_ERR, QUANT_MAX_ABS_ERR)),
])
def test_bounds_per_profile(bits, profile, expected):
    assert bounds_for_export(bits, profile) == expected


def _run(max_abs: float, mean_abs: float, flips: int = 0, gap: float = 1.0, explains: float = 0.0) -> LogitStats:
    """Four steps, the first ``flips`` of them flipped with the reference's ``gap`` between the two
    logits involved, of which the step's noise ``explains`` so much."""
    steps = tuple(StepStats(max_abs, mean_abs, gap, i >= flips, 1, 2, gap if i < flips else 0.0,
                            explains if i < flips else 0.0) for i in range(4))
    return LogitStats((4 - flips) / 4, max_abs, mean_abs, steps)


@pytest.mark.parametrize("oracle, kernels, failing", [
    (_run(1.5, 0.2), _run(1e-4, 1e-5), []),                       # fast noise, exact graph: pass
    (_run(1.5, 0.2, flips=2, gap=0.1, explains=1.2), _run(1e-4, 1e-5), []),  # near-ties flipped by the noise
    (_run(0.5, 0.05), _run(0.3, 0.01), ["exact kernels: max abs"]),  # a wrong graph hiding in the noise
    (_run(0.5, 0.05), _run(0.01, 0.001, flips=1, gap=0.5, explains=0.02), ["exact kernels: step 0"]),
    (_run(FAST_MAX_ABS_ERR, 0.1), _run(1e-4, 1e-5), ["max abs"]),
    (_run(2.0, FAST_MEAN_ABS_ERR), _run(1e-4, 1e-5), ["mean abs"]),
    (_run(2.0, 0.2, flips=1, gap=3.0, explains=2.5), _run(1e-4, 1e-5), ["step 0"]),
])
def test_judge_bounds_both_runs_of_a_fast_export(oracle, kernels, failing):
    bounds = bounds_for_export({4}, FAST)
    failures = judge(bounds, oracle, TokenizerCheck(True, 7, ()), kernels)
    assert len(failures) == len(failing)
    assert all(f.startswith(prefix) for f, prefix in zip(failures, failing))
    assert bounds.to_json() == {"profile": "fast", "max_abs_err": FAST_MAX_ABS_ERR,
                                "mean_abs_err": FAST_MEAN_ABS_ERR, "kernels_max_abs_err": QUANT_MAX_ABS_ERR}


@pytest.mark.slow
@pytest.mark.parametrize("profile", [FAST, EXACT])
def test_each_profile_ships_and_verifies(tiny_gemma4, tmp_path, profile):
    out = tmp_path / "out"
    export(tiny_gemma4("e2b"), out, ExportOptions(quant=QuantScheme(4, 64), runtime_profile=profile))
    config = json.loads((out / "config.json").read_text())
    assert config["memory"] == PROFILE_KEYS[profile]["memory"] and config["precision"] == "normal"
    report = verify_export(out, tiny_gemma4("e2b"), steps=16)
    print(f"\n{profile.value}: {summary_line(report)}")
    assert report.passed, report.failures
    assert report.runtime_profile is profile and report.bounds.profile == profile.value
    assert (report.exact_kernels is not None) == (profile is FAST)
    graph_check = report.exact_kernels if profile is FAST else report.oracle
    assert graph_check.max_abs_err < 0.01 and graph_check.greedy_match
    assert VerifyReport.read(out / "verify.json") == report


def _norm_epsilon(g):
    return "forward", g.Norm, lambda self, x: g.rms_norm(x, self.weight, self.eps * 100)


def _rope_direction(g):
    original = g._rotate
    return "_rotate", g, lambda x, cos, sin, head_dim: original(x, cos, -sin, head_dim)


def _layer_scalar(g):
    original = g.DecoderLayer.forward
    return "forward", g.DecoderLayer, lambda self, *args: original(self, *args) / self.layer_scalar


@pytest.mark.slow
@pytest.mark.parametrize("breakage", [_norm_epsilon, _rope_direction, _layer_scalar], ids=lambda f: f.__name__[1:])
def test_a_wrong_graph_fails_fast_verification(tiny_gemma4, tmp_path, monkeypatch, breakage):
    """Deliberately broken exports (the graph, not the weights, is wrong) shipped with the fast
    profile: verification fails. RMSNorm epsilons 100x too large move the logits by less than the
    fast kernels' own noise (measured 0.88 max, 0.11 mean), so only the exact-kernels run catches it."""
    from llmexport.models.gemma4 import graph as gemma4_graph

    attr, owner, broken = breakage(gemma4_graph)
    with monkeypatch.context() as patch:
        patch.setattr(owner, attr, broken)
        export(tiny_gemma4("e2b"), tmp_path / "out", ExportOptions(quant=QuantScheme(4, 64)))
    report = verify_export(tmp_path / "out", tiny_gemma4("e2b"), steps=16)
    print(f"\n{breakage.__name__}: {summary_line(report)}")
    assert not report.passed
    assert any(f.startswith("exact kernels:") for f in report.failures)
    if breakage is _norm_epsilon:
        assert report.oracle.max_abs_err < FAST_MAX_ABS_ERR
        assert report.oracle.mean_abs_err < FAST_MEAN_ABS_ERR


@pytest.mark.parametrize("precision", list(Precision))
@pytest.mark.parametrize("family", [{}, {"precision": "normal"}, {"precision": "low"}])
def test_precision_option_wins_over_the_family(precision, family):
    assert runtime_config(family, 4, None, FAST)["precision"] == family.get("precision", "low")
    config = runtime_config(family, 4, None, FAST, precision)
    assert config["precision"] == precision.value and profile_of(config) is FAST


def test_precision_option_cli_value_and_validation():
    from llmexport.cli import export_options, parse_command

    args = ["--path", "x", "--dst_path", "y"]
    assert ExportOptions().precision is None
    assert export_options(parse_command(args)).precision is None  # the family's
    assert export_options(parse_command([*args, "--precision", "low"])).precision is Precision.LOW
    with pytest.raises(UsageError, match="--precision"):
        ExportOptions(precision="low").validate()  # a plain string, not the enum
    import click

    with pytest.raises(click.BadParameter, match="fp8"):
        parse_command([*args, "--precision", "fp8"])


#: each family's config.json precision, decided by the fp16 measurements on MNN's ARM kernels
#: (docs/benchmarks.md, "fp16 on ARM"): changing one is changing that decision, with new numbers
SHIPPED_PRECISION = {
    # real Gemma activations overflow fp16
    "gemma3": "normal", "gemma3_text": "normal", "gemma4": "normal", "gemma4_text": "normal",
    "k2_horizon": "normal", "lfm2_moe": "normal", "qwen3_moe": "normal", "qwen3_5_moe": "normal",
    "qwen3_5_moe_text": "normal", "qwen3_vl_moe": "normal",  # routers: fp16 flips expert choices
    "llama": "low", "mistral": "low", "ministral": "low", "phi3": "low", "qwen2": "low", "qwen3": "low",
    "smollm3": "low", "lfm2": "low", "qwen3_5": "low", "qwen3_5_text": "low",
    "qwen3_vl": "low",  # Qwen3's text model (not measured on ARM apart from it)
}


def test_each_family_ships_its_measured_precision():
    import importlib

    from llmexport.models import FAMILIES

    assert set(SHIPPED_PRECISION) == set(FAMILIES)
    for model_type, spec in FAMILIES.items():
        module, name = spec.split(":")
        family = getattr(importlib.import_module(module), name)
        assert family.precision.value == SHIPPED_PRECISION[model_type], model_type
