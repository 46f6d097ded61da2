"""The export plan (what ``--dry-run`` prints) and the manifest written beside every export."""

from __future__ import annotations

import dataclasses
import functools
import json
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable

from llmexport.models.base import Architecture
from llmexport.options import ExportOptions
from llmexport.planning.digests import FileDigests, file_sha256
from llmexport.planning.memory_plan import memory_plan, summary_line
from llmexport.planning.schemes import Schemes
from llmexport.quant.budget import BudgetSummary
from llmexport.quant.scheme import QuantScheme
from llmexport.results import AdjustedBlock, ExportPlan, PlannedLinear, PlannedTable, PlannedTower, PrequantizedSummary
from llmexport.source.lora import LoraAdapter
from llmexport.spec import LinearSpec
from llmexport.targets import OutputTarget


def export_plan(arch: Architecture, options: ExportOptions, schemes: Schemes, target: OutputTarget) -> ExportPlan:
    """Every linear (text and towers) and table with its scheme, and their bytes in the target's files."""
    linears, adjusted, records = _planned(arch.linears(), schemes.linear, target)
    towers = {}
    for tower in arch.towers():
        tower_linears, tower_adjusted, tower_bytes = _planned(
            tower.linears(), functools.partial(schemes.tower, tower.name), target)
        towers[tower.name] = PlannedTower(tower_linears, tower_adjusted, tower_bytes)
    tables, total = {}, records
    for name, (table, choice) in schemes.tables().items():
        rows, dim = table.shape
        tables[name] = PlannedTable(rows, dim, choice.bits)
        total += target.table_bytes(rows, dim, choice.bits, choice.block)
    plan = ExportPlan(arch.describe(), linears, adjusted, tables, total,
                      schemes.prequantized(), towers=towers, budget=schemes.budget)
    return dataclasses.replace(plan, memory=memory_plan(arch, options, plan, records, target))


def _planned(specs: Iterable[LinearSpec], scheme_of: Callable[[LinearSpec], QuantScheme], target: OutputTarget
             ) -> tuple[tuple[PlannedLinear, ...], tuple[AdjustedBlock, ...], int]:
    """One graph's linears as planned, the blocks adjusted to their widths, and their bytes."""
    linears, adjusted, total = [], [], 0
    for spec in specs:
        scheme = scheme_of(spec)
        block = 0 if scheme.is_fp16 else scheme.block_for(spec.in_features)
        if not scheme.is_fp16 and scheme.block and block != scheme.block:
            adjusted.append(AdjustedBlock(spec.name, spec.in_features, requested=scheme.block, used=block))
        total += target.record_bytes(spec, scheme)
        linears.append(PlannedLinear(spec.name, spec.role, spec.out_features, spec.in_features, scheme.bits, block,
                                     scheme.sym, scheme.method))
    return tuple(linears), tuple(adjusted), total


def plan_summary(plan: ExportPlan) -> str:
    """Human-readable plan: architecture, layer kinds, schemes per role, adjusted blocks, size."""
    a = plan.architecture
    lines = [f"architecture: {a.family} (model_type {a.model_type}), {a.layers} layers, "
             f"hidden {a.hidden_size}, vocab {a.vocab_size}"]
    lines += [f"  layer {kind}" for kind in a.layer_kinds]
    lines.append("quantization (role: bits/block/sym/method x count):")
    lines += _scheme_lines(plan.linears, plan.adjusted_blocks)
    for name, t in plan.tables.items():
        lines.append(f"table {name}: {t.rows} x {t.dim} at {t.bits} bits")
    lines += _prequantized_lines(plan.prequantized)
    lines += budget_lines(plan.budget)
    lines.append(f"estimated size: {plan.estimated_bytes / 2**20:.1f} MiB")
    for name, tower in plan.towers.items():
        lines.append(f"tower {name}: {len(tower.linears)} linears, records {tower.record_bytes / 2**20:.1f} MiB "
                     f"in {name}.mnn.weight (beside its converted constants):")
        lines += _scheme_lines(tower.linears, tower.adjusted_blocks)
    if plan.memory is not None:
        lines.append(summary_line(plan.memory))
    return "\n".join(lines)


def _scheme_lines(linears: Iterable[PlannedLinear], adjusted: Iterable[AdjustedBlock]) -> list[str]:
    """Linears grouped by role and scheme, then the blocks adjusted to a width."""
    groups: dict[tuple, int] = {}
    for linear in linears:
        key = (linear.role.value, linear.bits, linear.block, linear.sym, linear.method.value)
        groups[key] = groups.get(key, 0) + 1
    lines = [f"  {r}: fp16 (not quantized) x {n}" if b == 16 else
             f"  {r}: {b} bits, block {bl}, {'sym' if s else 'asym'}, {m} x {n}"
             for (r, b, bl, s, m), n in sorted(groups.items())]
    return lines + [f"  block {adj.requested} does not divide {adj.name} (width {adj.in_features}): using {adj.used}"
                    for adj in adjusted]


#: how the plan names a pre-quantized format (PrequantizedSummary.format)
_SOURCE_NAMES = {"mlx-affine": "MLX", "gptq": "GPTQ", "gptq_v2": "GPTQ (v2)", "awq-gemm": "AWQ"}


def _prequantized_lines(pre: PrequantizedSummary | None) -> list[str]:
    """What a pre-quantized checkpoint keeps as stored and what it does not, with reasons."""
    if pre is None:
        return []
    source = _SOURCE_NAMES.get(pre.format, pre.format)
    lines = [f"{source} checkpoint, as stored by default: {pre.transcoded} linear(s) keep their integers "
             f"({pre.alpha}); {len(pre.kept_float)} float linear(s) stay fp16"]
    for changed, label in ((pre.requantized, "requantized"), (pre.quantized_from_float, "quantized")):
        lines += [f"  {label}: {e.name} ({e.stored} -> {e.bits} bits, block {e.block}): {e.reason}" for e in changed]
    for name, t in pre.tables.items():
        how = "kept as stored" if t.kept else f"{t.bits} bits: {t.reason}"
        lines.append(f"  table {name} ({t.stored}): {how}")
    return lines


def budget_lines(budget: BudgetSummary | None) -> list[str]:
    """What ``--target_bpw`` chose: the target and what was reached, then every linear in upgrade order."""
    if budget is None:
        return []
    lines = [f"size budget: target {budget.target_bpw:g} bits/weight over the text linears' records (lm_head "
             f"included, tables not), reached {budget.achieved_bpw:.3f} (possible {budget.min_bpw:.3f} to "
             f"{budget.max_bpw:.3f}); sensitivity {budget.proxy}",
             "  linear: chosen bits/block, score (loss at the base scheme) -> loss chosen, first upgrade's gain/byte"]
    lines += [f"  {c.name}: {c.bits} bits, block {c.block}, score {c.score:.4g} -> {c.loss:.4g}, "
              f"gain/byte {c.gain_per_byte:.4g}" for c in budget.choices]
    return lines


def _versions() -> dict[str, str]:
    out = {}
    for package in ("llmexport", "torch", "transformers", "MNN", "onnx", "safetensors"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = "not installed"
    return out


def write_manifest(out: Path, options: ExportOptions, plan: ExportPlan, digests: FileDigests | None = None,
                   adapter: LoraAdapter | None = None, source: dict[str, Any] | None = None) -> None:
    """manifest.json: file hashes, versions, options and the detected architecture; the LoRA adapter
    merged into the weights (its settings and its files' sha256), if any; for a hub repo, ``source``:
    its id, the revision asked for and the commit exported. ``digests``: the hashes taken while the
    files were written (llmexport/planning/digests.py); the others are read from disk."""
    sha256 = (digests or FileDigests()).sha256
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)}
             for p in sorted(out.iterdir()) if p.is_file() and p.name != "manifest.json"}
    manifest = {"versions": _versions(), "architecture": plan.architecture.to_json(),
                "options": _jsonable(options.manifest_fields()),
                "adjusted_blocks": [a.to_json() for a in plan.adjusted_blocks], "files": files}
    if plan.prequantized is not None:
        manifest["prequantized"] = plan.prequantized.to_json()
    if adapter is not None:
        manifest["lora"] = {**adapter.summary(), "sha256": {p.name: file_sha256(p) for p in adapter.files()}}
    if source is not None:
        manifest["source"] = source
    if plan.budget is not None:
        manifest["budget"] = plan.budget.to_json()
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "value"):  # enums
        return value.value
    return value
