"""--target_bpw: the allocator's properties, the plan --dry-run shows, the export that writes it,
and the one-line refusals."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from llmexport.api import export, plan
from llmexport.cli import main
from llmexport.options import ExportOptions
from llmexport.quant.budget import BudgetError, BudgetItem, Rung, allocate, candidate_schemes
from llmexport.quant.scheme import QuantMethod, QuantScheme
from llmexport.spec import LinearRole

BASE = QuantScheme(4, 64)


def _item(name: str, costs: list[int], losses: list[float]) -> BudgetItem:
    rungs, total = [], 0
    for cost, loss in zip(costs, losses):
        total += cost
        rungs.append(Rung(BASE, 64, total, loss))
    return BudgetItem(name, 100, tuple(rungs))


ITEMS = st.lists(st.tuples(st.lists(st.integers(1, 50), min_size=1, max_size=4),
                           st.lists(st.floats(0, 10, allow_nan=False), min_size=4, max_size=4)),
                 min_size=1, max_size=8).map(
    lambda raw: [_item(f"l{i}", costs, losses[:len(costs)]) for i, (costs, losses) in enumerate(raw)])


def _bytes(items, chosen) -> int:
    return sum(item.rungs[chosen[item.name]].bytes for item in items)


def _loss(items, chosen) -> float:
    return sum(item.rungs[chosen[item.name]].loss for item in items)


@settings(max_examples=200, deadline=None)
@given(ITEMS, st.integers(0, 400), st.integers(0, 400))
def test_budget_is_respected_and_more_never_costs_quality(items, extra_a, extra_b):
    base = sum(item.rungs[0].bytes for item in items)
    small, large = base + min(extra_a, extra_b), base + max(extra_a, extra_b)
    chosen_small, chosen_large = allocate(items, small), allocate(items, large)
    assert _bytes(items, chosen_small) <= small and _bytes(items, chosen_large) <= large
    assert _loss(items, chosen_large) <= _loss(items, chosen_small) + 1e-9
    # every upgrade lowers the estimated loss of its linear
    assert all(item.rungs[chosen_large[item.name]].loss <= item.rungs[0].loss for item in items)


@settings(max_examples=100, deadline=None)
@given(ITEMS, st.integers(0, 400))
def test_fixed_bytes_count_and_a_too_small_budget_is_refused(items, fixed):
    base = sum(item.rungs[0].bytes for item in items)
    assert _bytes(items, allocate(items, base + fixed + 10, fixed)) <= base + 10
    with pytest.raises(BudgetError):
        allocate(items, base + fixed - 1, fixed)


def test_ties_go_to_the_earlier_linear_and_repeat_exactly():
    twins = [_item("first", [10, 10], [4.0, 2.0]), _item("second", [10, 10], [4.0, 2.0])]
    chosen = allocate(twins, 30)
    assert chosen == {"first": 1, "second": 0} == allocate(twins, 30)
    assert allocate(twins[::-1], 30) == {"second": 1, "first": 0}


def test_the_largest_gain_per_byte_is_bought_first_and_dominated_rungs_are_skipped():
    items = [_item("cheap", [10, 5], [1.0, 0.5]),              # 0.1 per byte
             _item("head", [10, 5, 40], [9.0, 8.9, 0.0]),       # block 32: 0.02/byte; 8 bits from base: 0.2/byte
             _item("flat", [10, 5], [1.0, 1.0])]                # no gain: never upgraded
    assert allocate(items, 30 + 45) == {"cheap": 0, "head": 2, "flat": 0}
    assert allocate(items, 30 + 50) == {"cheap": 1, "head": 2, "flat": 0}
    assert allocate(items, 30 + 44) == {"cheap": 1, "head": 0, "flat": 0}  # head does not fit: cheap still does


def test_candidates_grow_from_the_command_line_scheme():
    hqq = QuantScheme(4, 128, sym=True, method=QuantMethod.HQQ)
    assert [(s.bits, s.block) for s in candidate_schemes(hqq)] == [(4, 128), (4, 32), (8, 128)]
    assert all(s.sym and s.method is QuantMethod.HQQ for s in candidate_schemes(hqq))
    assert [(s.bits, s.block) for s in candidate_schemes(QuantScheme(4, 32))] == [(4, 32), (8, 32)]
    assert [(s.bits, s.block) for s in candidate_schemes(QuantScheme(2, 0))] == [(2, 0), (2, 32), (4, 0), (8, 0)]
    assert [(s.bits, s.block) for s in candidate_schemes(QuantScheme(8, 64))] == [(8, 64), (8, 32)]
    assert candidate_schemes(QuantScheme(16)) == (QuantScheme(16),)


@pytest.fixture(scope="module")
def span(tiny_decoder):
    """(path, smallest and largest bits per weight) of a tiny tied Llama; the largest budget gives
    every linear 8 bits."""
    path = tiny_decoder("llama3-tied")
    budget = plan(path, ExportOptions(target_bpw=16)).budget
    assert budget is not None
    assert {c.bits for c in budget.choices} == {8} and budget.achieved_bpw == budget.max_bpw
    return path, budget.min_bpw, budget.max_bpw


def test_dry_run_shows_the_target_and_every_linear_in_upgrade_order(span, tmp_path):
    path, low, high = span
    target = round((low + high) / 2, 2)
    result = CliRunner().invoke(main, ["--path", str(path), "--dst_path", str(tmp_path / "o"), "--dry-run",
                                       "--target_bpw", str(target)])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "o").exists()
    planned = plan(path, ExportOptions(target_bpw=target))
    budget = planned.budget
    assert budget is not None and budget.target_bpw == target and low <= budget.achieved_bpw <= target
    lines = result.output.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("size budget: target"))
    assert f"reached {budget.achieved_bpw:.3f}" in lines[head] and "measured KLD on 512 random tokens" in lines[head]
    listed = [line.split(":")[0].strip() for line in lines[head + 2:head + 2 + len(budget.choices)]]
    assert listed == [c.name for c in budget.choices]
    assert sorted(listed) == sorted(linear.name for linear in planned.linears)
    gains = [c.gain_per_byte for c in budget.choices]
    assert gains == sorted(gains, reverse=True)
    # the plan's linears are the budget's choices, and some but not all were upgraded
    by_name = {linear.name: linear for linear in planned.linears}
    assert all((by_name[c.name].bits, by_name[c.name].block) == (c.bits, c.block) for c in budget.choices)
    assert 0 < sum(c.bits == 8 for c in budget.choices) < len(budget.choices)
    # the bits per weight the plan reports are the records' own (tied: the records are all the weights)
    weights = sum(linear.out_features * linear.in_features for linear in planned.linears)
    assert not planned.tables and math.isclose(8 * planned.estimated_bytes / weights, budget.achieved_bpw,
                                               abs_tol=1e-4)


@pytest.mark.parametrize("flags, needle", [
    (["--target_bpw", "3"], "--target_bpw: 3 bits per weight is below the smallest candidate: every linear at "
                            "--quant_bit 4, --quant_block 64 takes 4."),
    (["--target_bpw", "16.5"], "--target_bpw: must be a number of bits per weight in (0, 16]"),
    (["--target_bpw", "nan"], "--target_bpw: must be a number of bits per weight in (0, 16]"),
    (["--target_bpw", "-1"], "--target_bpw: must be a number of bits per weight in (0, 16]"),
    (["--target_bpw", "5", "--quant_bit", "16"], "--target_bpw: the budget upgrades linears from a quantized"),
    (["--target_bpw", "5", "--export", "onnx"], "--target_bpw: the budget counts MNN's quantized records"),
    (["--target_bpw", "5", "--lm_quant_bit", "8"], "--lm_quant_bit/--lm_quant_block choose some too"),
    (["--target_bpw", "5", "--quant_config", "mlp4-attn8"], "--quant_config rules choose some too"),
])
def test_bad_budgets_are_one_line_usage_errors(span, tmp_path, flags, needle):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "previous.txt").write_text("old export")
    result = CliRunner().invoke(main, ["--path", str(span[0]), "--dst_path", str(dst), *flags])
    assert result.exit_code == 2, result.output
    assert needle in result.output and len(result.output.strip().splitlines()) == 1
    assert [p.name for p in dst.iterdir()] == ["previous.txt"]


def test_a_non_numeric_budget_is_refused_by_the_parser(span, tmp_path):
    result = CliRunner().invoke(main, ["--path", str(span[0]), "--dst_path", str(tmp_path / "o"),
                                       "--target_bpw", "five"])
    assert result.exit_code == 2 and "'--target_bpw': 'five' is not a valid float" in result.output
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_export_writes_the_budgets_choices(span, tmp_path):
    from llmexport.mnn.readback import linear_records
    from llmexport.verification.verify import verify_export

    path, low, high = span
    target = round(low + (high - low) / 4, 2)
    out = tmp_path / "out"
    result = export(path, out, ExportOptions(target_bpw=target))
    budget = result.plan.budget
    assert budget is not None
    records = linear_records(out)
    for choice in budget.choices:
        quant = records[choice.name]["quanParameter"]
        ic, oc = records[choice.name]["ic"], records[choice.name]["oc"]
        assert quant["aMaxOrBits"] == choice.bits
        assert ic // (quant["readType"] // oc) == choice.block  # the record's own block
    assert any(c.bits == 8 for c in budget.choices) and any(c.bits == 4 for c in budget.choices)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["options"]["target_bpw"] == target
    assert manifest["budget"] == budget.to_json()
    head = next(c for c in budget.choices if c.name == "lm_head")
    assert manifest["budget"]["choices"][budget.choices.index(head)]["bits"] == head.bits
    report = verify_export(out, path, steps=12)
    assert report.passed, report.failures


def test_without_a_budget_the_plan_and_manifest_are_as_before(span):
    """Without --target_bpw the plan carries no budget and the manifest's options no target."""
    planned = plan(span[0], ExportOptions())
    assert planned.budget is None and "budget" not in planned.to_json()
    assert "target_bpw" not in ExportOptions().manifest_fields()
    assert any(linear.role is LinearRole.LM_HEAD for linear in planned.linears)
