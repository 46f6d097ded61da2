"""Tower verification: each exported tower in MNN against HF, as its ``TowerCheck`` describes.

The fair oracle is HF carrying the export's stored text weights and the tower weights read back
from ``{name}.mnn.weight`` (every tower linear's record, decoded as MNN decodes it); the fp32 HF
is reported beside it. One model is in memory at a time. A tower's section of ``verify.json``:
``passed``, ``failures``, the check's ``notes``, ``feature_bound``, one row per tower-alone case
(under ``cases_key``: the case's fields, then ``measures``) and one report per media prompt
(llmexport/verification_media.py).
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from llmexport.mnn.convert import mnn_to_json
from llmexport.mnn.runtime import run_module
from llmexport.mnn.weight_reader import read_linear
from llmexport.models.base import Architecture, Tower
from llmexport.models.tower_check import FeatureCase, Measure, TowerCheck
from llmexport.spec import StoredWeights
from llmexport.verification_media import check_media_prompts, fp32_forced_logits, oracle_runs

#: placeholder name -> (weight [out, in], bias) as the export stored them
TowerWeights = dict[str, tuple[torch.Tensor, torch.Tensor | None]]


def verify_towers(arch: Architecture, export_dir: Path, stored_text: StoredWeights) -> dict[str, dict[str, Any]]:
    """``verify.json``'s ``towers``: one section per tower of ``arch``, keyed by its name."""
    return {tower.name: verify_tower(arch, tower, export_dir, stored_text) for tower in arch.towers()}


def verify_tower(arch: Architecture, tower: Tower, export_dir: Path, stored_text: StoredWeights,
                 check: TowerCheck | None = None) -> dict[str, Any]:
    """One tower's section (``check``: ``tower.check()`` unless given, e.g. with other prompts)."""
    check = tower.check() if check is None else check
    outputs = run_module(export_dir / f"{tower.name}.mnn", [case.feeds for case in check.cases], [check.output])
    stored = read_tower_weights(export_dir, tower.name, {spec.name for spec in tower.linears()})

    oracle = arch.load_reference(stored_text)
    apply_stored_tower(oracle, tower, stored)
    refs, runs = check.features(oracle), oracle_runs(oracle, check)
    del oracle
    fp32 = arch.load_reference(None)
    refs32, logits32 = check.features(fp32), fp32_forced_logits(fp32, check, runs)
    del fp32

    rows, failures = [], []
    for case, out, ref, ref32 in zip(check.cases, outputs, refs, refs32):
        values = measure(check, out[check.output], ref, ref32)
        rows.append({**case.info, **{key: values[m] for key, m in check.measures.items()}})
        failures += case_failures(check, case, values)
    prompts = check_media_prompts(export_dir, check, runs, logits32)
    failures += [f"{prompt.name}: {f}" for prompt, report in zip(check.prompts, prompts) for f in report["failures"]]
    return {"passed": not failures, "failures": failures, **check.notes, "feature_bound": check.feature_bound,
            check.cases_key: rows, "prompts": prompts}


def measure(check: TowerCheck, output: np.ndarray, ref: torch.Tensor, ref32: torch.Tensor) -> dict[Measure, Any]:
    """The graph's ``output`` [1, rows, hidden] against HF's features ``ref`` (stored weights) and
    ``ref32`` (fp32), in HF's scale; errors are infinite when the shapes differ."""
    mnn = output[0, :ref.shape[0]] if check.keeps_first_rows else output[0]
    if check.feature_columns is not None:
        mnn = mnn[..., :check.feature_columns]
    mnn = mnn / check.output_scale
    same = mnn.shape == tuple(ref.shape)
    return {Measure.ROWS: int(ref.shape[0]), Measure.MNN_ROWS: int(mnn.shape[0]),
            Measure.REL_ERR: relative_error(mnn, ref) if same else math.inf,
            Measure.MAX_ABS_ERR: float(np.abs(mnn - ref.numpy()).max()) if same else math.inf,
            Measure.REL_ERR_FP32: relative_error(mnn, ref32) if mnn.shape == tuple(ref32.shape) else math.inf}


def case_failures(check: TowerCheck, case: FeatureCase, values: dict[Measure, Any]) -> list[str]:
    rel = values[Measure.REL_ERR]
    return [f"{case.name}: relative error {rel:.2e} >= {check.feature_bound}"] if rel >= check.feature_bound else []


def relative_error(out: np.ndarray | torch.Tensor, ref: np.ndarray | torch.Tensor) -> float:
    """max |out - ref| / max |ref| (elementwise ratios explode on near-zero entries)."""
    out, ref = np.asarray(out, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        raise ValueError(f"shapes differ: {out.shape} vs {ref.shape}")
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))


def read_tower_weights(export_dir: Path, stem: str, names: set[str]) -> TowerWeights:
    """The linears ``names`` of ``{stem}.mnn`` decoded from ``{stem}.mnn.weight``. Other
    convolutions (an audio tower's subsampling) are graph constants, not linear records."""
    with tempfile.TemporaryDirectory(prefix="llmexport-readback-") as tmp:
        graph = mnn_to_json(export_dir / f"{stem}.mnn", Path(tmp) / f"{stem}.json")
    out = {}
    for op in graph["oplists"]:
        main = op.get("main", {})
        if op.get("type") == "Convolution" and "external" in main and op.get("name") in names:
            out[op["name"]] = read_linear(export_dir / f"{stem}.mnn.weight", main["external"],
                                          main.get("quanParameter", {}), main["common"]["outputCount"],
                                          main["common"]["inputCount"])
    return out


def apply_stored_tower(model: nn.Module, tower: Tower, stored: TowerWeights) -> None:
    """Copy a tower's stored weights into the HF model (the fair oracle for the runtime): each
    linear's into the parameters its ``linear_source`` names."""
    params = dict(model.named_parameters())
    names = [spec.name for spec in tower.linears()]
    missing = [name for name in names if name not in stored]
    if missing:
        raise ValueError(f"{len(missing)} tower linear(s) not found in the exported graph, e.g. {missing[0]!r}")
    with torch.no_grad():
        for name in names:
            weight, bias = stored[name]
            source = tower.linear_source(name)
            target = params[source.weight] if source.expert is None else params[source.weight][source.expert]
            target.copy_(weight.float())
            if source.bias is not None and bias is not None:
                params[source.bias].copy_(bias.float())
