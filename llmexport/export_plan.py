"""The export plan (what ``--dry-run`` prints) and the manifest written beside every export."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from importlib import metadata
from pathlib import Path
from typing import Any

from llmexport.memory_plan import memory_plan, summary_line
from llmexport.models.base import Architecture
from llmexport.options import ExportOptions
from llmexport.quant.scheme import QuantMethod, QuantScheme
from llmexport.results import AdjustedBlock, ExportPlan, PlannedLinear, PlannedTable
from llmexport.weight_sources import WeightSources


def record_bytes(out_features: int, in_features: int, scheme: QuantScheme, bias: bool = False) -> int:
    """Size of one linear record in llm.mnn.weight (see docs/output-format.md)."""
    extra = 4 * out_features if bias else 0
    if scheme.is_fp16:
        return 2 * out_features * in_features + extra
    block = scheme.block_for(in_features)
    wide = out_features > 65535 or in_features > 65535
    header = 1 + (8 if wide else 4) + 1 + 2 ** scheme.bits
    levels = math.ceil(out_features * in_features * scheme.bits / 8)
    alpha_size = 4 if scheme.method is QuantMethod.STORED else 2  # transcoded records keep fp32 alpha
    alpha = out_features * (in_features // block) * (1 if scheme.sym else 2) * alpha_size
    return header + levels + alpha + extra


def table_bytes(rows: int, dim: int, bits: int, block: int) -> int:
    if bits == 16:
        return rows * dim * 2
    used = dim if block == 0 else block
    return rows * dim * bits // 8 + rows * (dim // used) * 2 * 4


def export_plan(arch: Architecture, options: ExportOptions, sources: WeightSources | None = None) -> ExportPlan:
    sources = sources or WeightSources(arch, options)
    linears, adjusted, records = [], [], 0
    for spec in arch.linears():
        scheme = sources.scheme(spec)
        block = 0 if scheme.is_fp16 else scheme.block_for(spec.in_features)
        if not scheme.is_fp16 and scheme.block and block != scheme.block:
            adjusted.append(AdjustedBlock(spec.name, spec.in_features, requested=scheme.block, used=block))
        records += record_bytes(spec.out_features, spec.in_features, scheme, spec.bias)
        linears.append(PlannedLinear(spec.name, spec.role, spec.out_features, spec.in_features, scheme.bits, block,
                                     scheme.sym, scheme.method))
    tables, total = {}, records
    for name, (table, choice) in sources.tables().items():
        rows, dim = table.shape
        tables[name] = PlannedTable(rows, dim, choice.bits)
        total += table_bytes(rows, dim, choice.bits, choice.block)
    plan = ExportPlan(arch.describe(), tuple(linears), tuple(adjusted), tables, total,
                      sources.summary())
    return dataclasses.replace(plan, memory=memory_plan(arch, options, plan, records))


def plan_summary(plan: ExportPlan) -> str:
    """Human-readable plan: architecture, layer kinds, schemes per role, adjusted blocks, size."""
    a = plan.architecture
    lines = [f"architecture: {a.family} (model_type {a.model_type}), {a.layers} layers, "
             f"hidden {a.hidden_size}, vocab {a.vocab_size}"]
    lines += [f"  layer {kind}" for kind in a.layer_kinds]
    groups: dict[tuple, int] = {}
    for linear in plan.linears:
        key = (linear.role.value, linear.bits, linear.block, linear.sym, linear.method.value)
        groups[key] = groups.get(key, 0) + 1
    lines.append("quantization (role: bits/block/sym/method x count):")
    lines += [f"  {r}: fp16 (not quantized) x {n}" if b == 16 else
              f"  {r}: {b} bits, block {bl}, {'sym' if s else 'asym'}, {m} x {n}"
              for (r, b, bl, s, m), n in sorted(groups.items())]
    for adj in plan.adjusted_blocks:
        lines.append(f"  block {adj.requested} does not divide {adj.name} (width {adj.in_features}): using {adj.used}")
    for name, t in plan.tables.items():
        lines.append(f"table {name}: {t.rows} x {t.dim} at {t.bits} bits")
    lines += _prequantized_lines(plan.prequantized)
    lines.append(f"estimated size: {plan.estimated_bytes / 2**20:.1f} MiB")
    if plan.memory is not None:
        lines.append(summary_line(plan.memory))
    return "\n".join(lines)


def _prequantized_lines(pre: dict[str, Any] | None) -> list[str]:
    """What a pre-quantized (MLX) checkpoint keeps as stored and what it does not, with reasons."""
    if not pre:
        return []
    lines = [f"MLX checkpoint, as stored by default: {pre['transcoded']} linear(s) keep their integers "
             f"({pre['alpha']}); {len(pre['kept_float'])} float linear(s) stay fp16"]
    for key, label in (("requantized", "requantized"), ("quantized_from_float", "quantized")):
        lines += [f"  {label}: {e['name']} ({e['stored']} -> {e['bits']} bits, block {e['block']}): {e['reason']}"
                  for e in pre[key]]
    for name, t in pre["tables"].items():
        how = "kept as stored" if t["kept"] else f"{t['bits']} bits: {t['reason']}"
        lines.append(f"  table {name} ({t['stored']}): {how}")
    return lines


def _versions() -> dict[str, str]:
    out = {}
    for package in ("llmexport", "torch", "transformers", "MNN", "onnx", "safetensors"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = "not installed"
    return out


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in 1 MiB blocks (the manifest's, and what tests and benches check)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(out: Path, options: ExportOptions, plan: ExportPlan) -> None:
    """manifest.json: file hashes, versions, options and the detected architecture."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
             for p in sorted(out.iterdir()) if p.is_file() and p.name != "manifest.json"}
    manifest = {"versions": _versions(), "architecture": plan.architecture.to_json(),
                "options": _jsonable(options.manifest_fields()),
                "adjusted_blocks": [a.to_json() for a in plan.adjusted_blocks], "files": files}
    if plan.prequantized is not None:
        manifest["prequantized"] = plan.prequantized
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "value"):  # enums
        return value.value
    return value
