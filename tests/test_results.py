"""The typed results (llmexport.results): ``to_json()`` is JSON-ready, keeps the documented key
order and reads back with ``from_json()``; the plan of every registered family round-trips; the
dry-run text and the verify summary line keep their format; the API's layering is one way."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import llmexport
from llmexport.mnn.config import RuntimeProfile
from llmexport.options import ExportOptions
from llmexport.planning.export_plan import plan_summary
from llmexport.quant.scheme import QuantMethod, QuantScheme
from llmexport.results import (
    AdjustedBlock,
    ArchitectureSummary,
    Bounds,
    ChangedLinear,
    ConversationCheck,
    ConversationTurn,
    ExportPlan,
    LogitStats,
    LogitSummary,
    MediaPromptReport,
    MemoryPlan,
    PlannedLinear,
    PlannedTable,
    PlannedTower,
    PrequantizedSummary,
    PrequantizedTable,
    RunComparison,
    StepStats,
    TokenizerCheck,
    TowerReport,
    VerifyReport,
)
from llmexport.source.checkpoint import Checkpoint
from llmexport.source.loading import open_architecture
from llmexport.spec import LinearRole
from llmexport.tiny.registry import TINY_BUILDERS
from llmexport.verification.logits import compare_logits
from llmexport.verification.verify import judge, summary_line

# verify.json's keys, in the order it is written (docs/verification.md); [optional] ones in brackets
REPORT_KEYS = ["prompt_tokens", "steps", "tokenizer", "runtime_profile", "oracle", "fp32", "towers",
               "[prequantized]", "[exact_kernels]", "[conversation]", "bounds", "failures", "passed"]
RUN_KEYS = ["greedy_ref", "greedy_mnn", "greedy_match", "top1_agreement", "max_abs_err", "mean_abs_err", "per_step"]
STEP_KEYS = ["max_abs_err", "mean_abs_err", "ref_top2_margin", "top1_match", "mnn_top1", "ref_top1", "ref_gap",
             "noise_explains"]
# a tower's section: its notes after failures, its cases' key after feature_bound; a media prompt's
# keys, then its own fields (docs/verification.md)
TOWER_KEYS = ["passed", "failures", "<notes>", "feature_bound", "<cases>", "prompts", "conversation"]
PROMPT_KEYS = ["prompt_tokens", "ids_match", "greedy_ref", "greedy_mnn", "greedy_match", "[forced]", "[fp32]",
               "failures", "label", "stopped_at_media_token", "bos_count"]
PLAN_KEYS = ["architecture", "linears", "adjusted_blocks", "tables", "estimated_bytes", "[towers]", "[prequantized]",
             "[memory]"]
LINEAR_KEYS = ["name", "role", "shape", "bits", "block", "sym", "method"]

floats = st.floats(allow_nan=False, allow_infinity=False)
small = st.integers(0, 1 << 20)
names = st.text(max_size=12)
json_values = st.recursive(st.none() | st.booleans() | small | floats | names,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(names, inner, max_size=3),
                           max_leaves=8)
json_dicts = st.dictionaries(names, json_values, max_size=3)
ids = st.lists(small, max_size=4).map(tuple)

steps = st.builds(StepStats, floats, floats, floats, st.booleans(), small, small, floats, floats)
logit_stats = st.builds(LogitStats, floats, floats, floats, st.lists(steps, max_size=3).map(tuple))


@st.composite
def runs(draw) -> RunComparison:
    greedy_ref = draw(ids)
    return RunComparison.of(draw(logit_stats), greedy_ref, draw(st.just(greedy_ref) | ids))


turns = st.builds(ConversationTurn, small, small, small, small, small, st.booleans(), st.none() | small, names, names,
                  st.lists(names, max_size=2).map(tuple), runs(), logit_stats, st.none() | runs())
conversations = st.builds(ConversationCheck, small, small, st.lists(turns, max_size=3).map(tuple), st.none() | names)
prompt_info = st.dictionaries(names.filter(lambda k: k not in MediaPromptReport._OWN), json_values, max_size=2)
media_prompts = st.builds(MediaPromptReport, small, st.booleans(), ids, ids, st.lists(names, max_size=2).map(tuple),
                          st.none() | logit_stats, st.none() | st.builds(LogitSummary, floats, floats, floats), names,
                          st.booleans(), small, prompt_info)


@st.composite
def tower_reports(draw) -> TowerReport:
    reserved = set(TOWER_KEYS)
    cases_key = draw(names.filter(lambda k: k not in reserved))
    notes = draw(st.dictionaries(names.filter(lambda k: k not in reserved | {cases_key}), json_values, max_size=2))
    return TowerReport(draw(st.lists(names, max_size=2).map(tuple)), draw(floats), cases_key,
                       draw(st.lists(json_dicts, max_size=2).map(tuple)),
                       draw(st.lists(media_prompts, max_size=2).map(tuple)), notes,
                       draw(st.none() | conversations | names.map(lambda why: f"skipped: {why}")))


reports = st.builds(
    VerifyReport, small, small, st.builds(TokenizerCheck, st.booleans(), small, st.lists(names, max_size=2).map(tuple)),
    st.sampled_from(RuntimeProfile), runs(), logit_stats,
    st.builds(Bounds, st.sampled_from(["fast", "exact"]), floats, st.none() | floats, st.none() | floats),
    st.lists(names, max_size=3).map(tuple), st.dictionaries(names, tower_reports(), max_size=2),
    st.none() | json_dicts, st.none() | runs(), st.none() | conversations)

_KNOWN = set(ArchitectureSummary._HEAD + ArchitectureSummary._TAIL)
architectures = st.builds(ArchitectureSummary, names, names, small, small, small, st.booleans(),
                          st.lists(names, max_size=3).map(tuple),
                          st.dictionaries(names.filter(lambda k: k not in _KNOWN), json_values, max_size=3))
# Schemes.prequantized() of a pre-quantized (MLX) checkpoint, printed by the dry run
_changed = st.lists(st.builds(ChangedLinear, names, names, names, small, small), max_size=2).map(tuple)
prequantized = st.builds(
    PrequantizedSummary, names, names, names, small, st.lists(names, max_size=2).map(tuple), _changed, _changed,
    st.dictionaries(names, st.builds(PrequantizedTable, st.none() | names, small, small, st.booleans(),
                                     st.none() | names), max_size=2))
_linears = st.lists(st.builds(PlannedLinear, names, st.sampled_from(LinearRole), small, small,
                              st.sampled_from([2, 3, 4, 8, 16]), small, st.booleans(), st.sampled_from(QuantMethod)),
                    max_size=4).map(tuple)
_adjusted = st.lists(st.builds(AdjustedBlock, names, small, small, small), max_size=2).map(tuple)
plans = st.builds(
    ExportPlan, architectures,
    _linears, _adjusted,
    st.dictionaries(names, st.builds(PlannedTable, small, small, st.sampled_from([4, 8, 16])), max_size=2),
    small, st.none() | prequantized, st.none() | st.builds(MemoryPlan, small, st.none() | small),
    st.dictionaries(st.sampled_from(["visual", "audio"]), st.builds(PlannedTower, _linears, _adjusted, small),
                    max_size=2))


def _plain_json(value) -> bool:
    """Only JSON's own types (no tuples, no enums, which compare equal to their values)."""
    if type(value) is dict:
        return all(type(k) is str and _plain_json(v) for k, v in value.items())
    if type(value) is list:
        return all(map(_plain_json, value))
    return value is None or type(value) in (bool, int, float, str)


def _keys_in_order(data: dict, documented: list[str]) -> bool:
    expected = [k.strip("[]") for k in documented if not k.startswith("[") or k.strip("[]") in data]
    return list(data) == expected


@given(reports)
def test_report_json_is_plain_ordered_and_reads_back(report):
    data = report.to_json()
    assert _plain_json(data)
    assert _keys_in_order(data, REPORT_KEYS)
    assert ("exact_kernels" in data) == (report.exact_kernels is not None)
    for run in [data["oracle"]] + ([data["exact_kernels"]] if "exact_kernels" in data else []):
        assert list(run) == RUN_KEYS and all(list(s) == STEP_KEYS for s in run["per_step"])
        assert run["greedy_match"] == (run["greedy_ref"] == run["greedy_mnn"])
    assert list(data["fp32"]) == RUN_KEYS[3:]
    for name, tower in report.towers.items():
        section = data["towers"][name]
        assert list(section) == [k for key in TOWER_KEYS for k in {"<notes>": list(tower.notes),
                                                                   "<cases>": [tower.cases_key]}.get(key, [key])]
        assert section["passed"] == (not section["failures"]) == tower.passed
        for prompt, written in zip(tower.prompts, section["prompts"]):
            assert list(written) == [k.strip("[]") for k in PROMPT_KEYS if k.strip("[]") in written] + list(prompt.info)
            assert written["greedy_match"] == (written["greedy_ref"] == written["greedy_mnn"])
            assert ("forced" in written, "fp32" in written) == (prompt.forced is not None, prompt.fp32 is not None)
    assert data["passed"] == (not data["failures"]) == report.passed
    assert VerifyReport.from_json(json.loads(json.dumps(data))) == report


@given(reports)
def test_report_from_json_refuses_an_inconsistent_verdict(report):
    data = json.loads(json.dumps(report.to_json()))
    data["passed"] = not data["passed"]
    with pytest.raises(ValueError, match="passed="):
        VerifyReport.from_json(data)


@given(tower_reports())
def test_tower_section_from_json_refuses_an_inconsistent_verdict_or_layout(tower):
    data = json.loads(json.dumps(tower.to_json()))
    assert TowerReport.from_json(data) == tower
    with pytest.raises(ValueError, match="passed="):
        TowerReport.from_json({**data, "passed": not data["passed"]})
    with pytest.raises(ValueError, match="keys"):
        TowerReport.from_json({k: v for k, v in data.items() if k != tower.cases_key})


@given(plans)
def test_plan_json_is_plain_ordered_and_reads_back(plan):
    data = plan.to_json()
    assert _plain_json(data) and _keys_in_order(data, PLAN_KEYS)
    assert all(list(x) == LINEAR_KEYS for x in data["linears"])
    arch = data["architecture"]
    assert list(arch)[:5] == list(ArchitectureSummary._HEAD) and list(arch)[-2:] == list(ArchitectureSummary._TAIL)
    assert ExportPlan.from_json(json.loads(json.dumps(data))) == plan
    assert plan_summary(ExportPlan.from_json(data)) == plan_summary(plan)


@settings(max_examples=50, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(2, 9)),
                  elements=st.floats(-100, 100, width=32)), st.data())
def test_logit_comparison_matches_a_step_by_step_reading(mnn, data):
    ref = data.draw(hnp.arrays(np.float32, mnn.shape, elements=st.floats(-100, 100, width=32)))
    stats = compare_logits(mnn, ref)
    for step, m, r in zip(stats.per_step, mnn, ref):
        assert step.max_abs_err == float(np.max(np.abs(m - r))) and step.mean_abs_err == float(np.mean(np.abs(m - r)))
        assert step.ref_top2_margin == float(np.sort(r)[-1] - np.sort(r)[-2])
        a, b = int(r.argmax()), int(m.argmax())
        moved = 0.0 if a == b else abs(float(m[a]) - float(r[a])) + abs(float(m[b]) - float(r[b]))
        assert step.ref_gap == float(r[a]) - float(r[b]) and step.noise_explains == moved
        assert not step.flipped  # a flip measured on these arrays is always within its two movements
        assert (step.mnn_top1, step.ref_top1, step.top1_match) == (int(m.argmax()), int(r.argmax()),
                                                                   int(m.argmax()) == int(r.argmax()))
    assert stats.top1_agreement == np.mean([s.top1_match for s in stats.per_step])
    assert stats.max_abs_err == max(s.max_abs_err for s in stats.per_step)


errors = st.floats(0, 1e3)


@given(st.lists(st.builds(StepStats, errors, errors, errors, st.booleans(), small, small, errors, errors), min_size=1,
                max_size=5)
       .map(tuple), errors, errors)
def test_judge_fails_exactly_the_flipped_steps_and_the_exceeded_bounds(per_step, max_abs, mean_abs):
    stats = LogitStats(1.0, max(s.max_abs_err for s in per_step), float(np.mean([s.mean_abs_err for s in per_step])),
                       per_step)
    bounds = Bounds("fast", max_abs, mean_abs)
    failures = judge(bounds, stats, TokenizerCheck(True, 1, ()))
    flipped = [i for i, s in enumerate(per_step) if not s.top1_match and s.ref_gap > s.noise_explains]
    assert [f for f in failures if f.startswith("step ")] == [f"step {i}: top-1 {per_step[i].mnn_top1} != "
                                                             f"{per_step[i].ref_top1} (gap {per_step[i].ref_gap:.4f} > "
                                                             f"the {per_step[i].noise_explains:.4f} its two logits "
                                                             "moved)" for i in flipped]
    assert any(f.startswith("max abs") for f in failures) == (stats.max_abs_err >= max_abs)
    assert any(f.startswith("mean abs") for f in failures) == (stats.mean_abs_err >= mean_abs)
    assert judge(bounds, stats, TokenizerCheck(False, 3, ("a", "b")))[-1] == "tokenizer disagrees on 2 sample(s)"
    with pytest.raises(ValueError, match="kernels_max_abs_err"):  # an exact-kernels run is never left unjudged
        judge(bounds, stats, TokenizerCheck(True, 1, ()), exact_kernels=stats)


def _fixed_report(exact: bool) -> VerifyReport:
    step = StepStats(1e-4, 2e-5, 0.5, True, 3, 3, 0.0, 0.0)
    shipped = RunComparison.of(LogitStats(0.75, 1.25, 0.125, (step,)), [3, 4, 5], [3, 4, 6])
    kernels = RunComparison.of(LogitStats(1.0, 2.5e-4, 1e-5, (step,)), [3, 4, 5], [3, 4, 5]) if exact else None
    bounds = Bounds("fast", 8.0, 1.0, 0.2) if exact else Bounds("exact", 0.2)
    towers = {"visual": TowerReport((), 1e-3, "images", ())}
    return VerifyReport(40, 3, TokenizerCheck(True, 7, ()), RuntimeProfile.FAST if exact else RuntimeProfile.EXACT,
                        shipped, LogitStats(0.5, 2.0, 0.25, (step,)), bounds,
                        () if exact else ("max abs logit error 1.25000 >= 0.2",), towers, None, kernels)


def test_summary_line_format_is_unchanged():
    assert summary_line(_fixed_report(True)) == (
        "PASS (fast profile): vs stored-weights HF: top-1 75%, greedy differs, max |dlogit| 1.25e+00 (bound 8.0); "
        "exact kernels: top-1 100%, max |dlogit| 2.50e-04 (bound 0.2); vs fp32 HF: top-1 50%, max |dlogit| "
        "2.00e+00; tokenizer agrees; visual ok")
    assert summary_line(_fixed_report(False)) == (
        "FAIL (exact profile): vs stored-weights HF: top-1 75%, greedy differs, max |dlogit| 1.25e+00 (bound 0.2); "
        "vs fp32 HF: top-1 50%, max |dlogit| 2.00e+00; tokenizer agrees; visual ok")


def test_plan_summary_format_is_unchanged():
    arch = ArchitectureSummary("gemma4", "gemma4_text", 2, 64, 512, True, ("0: sliding", "1: full"), {"ple_dim": 16})
    linears = (PlannedLinear("a", LinearRole.MLP, 96, 64, 4, 64, False, QuantMethod.RTN),
               PlannedLinear("b", LinearRole.MLP, 64, 96, 4, 48, False, QuantMethod.RTN),
               PlannedLinear("lm_head", LinearRole.LM_HEAD, 512, 64, 8, 64, True, QuantMethod.HQQ))
    plan = ExportPlan(arch, linears, (AdjustedBlock("b", 96, 64, 48),), {"ple": PlannedTable(512, 32, 16)}, 3 << 20)
    assert plan_summary(plan) == "\n".join([
        "architecture: gemma4 (model_type gemma4_text), 2 layers, hidden 64, vocab 512", "  layer 0: sliding",
        "  layer 1: full", "quantization (role: bits/block/sym/method x count):",
        "  lm_head: 8 bits, block 64, sym, hqq x 1", "  mlp: 4 bits, block 48, asym, rtn x 1",
        "  mlp: 4 bits, block 64, asym, rtn x 1", "  block 64 does not divide b (width 96): using 48",
        "table ple: 512 x 32 at 16 bits", "estimated size: 3.0 MiB"])


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {model_type: build(root / model_type, 0) for model_type, build in sorted(TINY_BUILDERS.items())}


@pytest.mark.parametrize("bits", [4, 16])
@pytest.mark.parametrize("model_type", sorted(TINY_BUILDERS))
def test_every_family_plan_round_trips_and_the_dry_run_prints_it(family_checkpoints, model_type, bits):
    from click.testing import CliRunner

    from llmexport.cli import main

    path = family_checkpoints[model_type]
    summary = open_architecture(Checkpoint.open(path)).describe()
    described = summary.to_json()
    assert ArchitectureSummary.from_json(described) == summary
    assert list(ArchitectureSummary.from_json(described).to_json()) == list(described)  # same order
    plan = llmexport.plan(path, ExportOptions(quant=QuantScheme(bits, 32)))
    assert isinstance(plan, ExportPlan) and plan.architecture == summary
    assert ExportPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    result = CliRunner().invoke(main, ["--path", str(path), "--dst_path", "unused", "--dry-run", "--quant_bit",
                                       str(bits), "--quant_block", "32"])
    assert result.exit_code == 0, result.output
    summary, fit = result.stdout.rstrip("\n").rsplit("\n", 1)
    assert summary == plan_summary(plan) and fit.startswith("memory: ")  # the plan, then whether it fits here


def test_the_api_re_exports_the_results_and_the_pipeline_does_not_import_the_api():
    from llmexport import api, results

    for name in ("ExportPlan", "ExportResult", "VerifyReport"):
        assert getattr(llmexport, name) is getattr(api, name) is getattr(results, name)
    code = ("import sys, llmexport.pipeline, llmexport.results, llmexport.planning.export_plan; "
            "print(sorted(m for m in ('llmexport.api', 'llmexport.cli') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def test_quality_sections_round_trip_and_print():
    from dataclasses import replace

    from llmexport.verification.quality import QualityStats

    steps = QualityStats(3, 40.0, 41.0, 2.5e-3, 9e-3, 2 / 3)
    text = QualityStats(254, 12.5, 12.75, 1.25e-3, 4e-3, 0.9375)
    report = replace(_fixed_report(True), fp32_quality=steps, text_quality=("held-out.txt", text))
    assert VerifyReport.from_json(json.loads(json.dumps(report.to_json()))) == report
    assert summary_line(report) == (
        "PASS (fast profile): vs stored-weights HF: top-1 75%, greedy differs, max |dlogit| 1.25e+00 (bound 8.0); "
        "exact kernels: top-1 100%, max |dlogit| 2.50e-04 (bound 0.2); vs fp32 HF: top-1 50%, KLD 2.50e-03, "
        "max |dlogit| 2.00e+00; tokenizer agrees; visual ok; on held-out.txt vs fp32 HF: PPL 12.500 -> 12.750 "
        "(+0.250), KLD 1.25e-03 (p99 4.00e-03), top-1 93.8% over 254 positions")
