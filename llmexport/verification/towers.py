"""Tower verification: each exported tower in MNN against HF, as its ``TowerCheck`` describes.

The fair oracle is HF carrying the weights the export stored, the tower's linears decoded from
``{name}.mnn.weight`` as MNN decodes them (``mnn.readback.StoredTensors``); the fp32 HF is reported
beside it. Both are streamed references (llmexport/reference/streamed.py): a tower's layers are in
memory one at a time. A tower's section of ``verify.json`` is a ``TowerReport`` (llmexport/results.py):
``passed``, ``failures``, the check's ``notes``, ``feature_bound``, one row per tower-alone case
(under ``cases_key``: the case's fields, then ``measures``), one ``MediaPromptReport`` per media
prompt (llmexport/verification/media.py) and the media conversation, a chat opened with the
last prompt's medium and continued with text (llmexport/verification/media_chat.py).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from llmexport.mnn.runtime import run_module
from llmexport.models.base import Architecture, Tower
from llmexport.models.tower_check import FeatureCase, Measure, TowerCheck
from llmexport.results import TowerReport
from llmexport.verification.media import check_media_prompts
from llmexport.verification.media_chat import media_conversation, media_conversation_failures


def verify_towers(arch: Architecture, export_dir: Path, oracle: nn.Module, fp32: nn.Module,
                  media: bool = True, media_max_abs: float | None = None) -> dict[str, TowerReport]:
    """``verify.json``'s ``towers``: one section per tower of ``arch``, keyed by its name
    (``oracle``: HF carrying the stored weights; ``fp32``: HF as the checkpoint holds it;
    ``media``: False leaves the media prompts and the media conversation out, which run the whole
    model on MNN's exact kernels; ``media_max_abs``: the export's bound for a run on those kernels,
    applied to the prompts' and the conversation's logits)."""
    return {tower.name: verify_tower(tower, export_dir, oracle, fp32, media=media, media_max_abs=media_max_abs,
                                     chat=arch)
            for tower in arch.towers()}


def verify_tower(tower: Tower, export_dir: Path, oracle: nn.Module, fp32: nn.Module,
                 check: TowerCheck | None = None, media: bool = True,
                 media_max_abs: float | None = None, chat: Architecture | None = None) -> TowerReport:
    """One tower's section (``check``: ``tower.check()`` unless given, e.g. with other prompts;
    ``chat``: the architecture, to run the media conversation too when ``media``)."""
    check = tower.check() if check is None else check
    outputs = run_module(export_dir / f"{tower.name}.mnn", [case.feeds for case in check.cases], [check.output])
    refs, refs32 = check.features(oracle), check.features(fp32)
    rows, failures = [], []
    for case, out, ref, ref32 in zip(check.cases, outputs, refs, refs32):
        values = measure(check, out[check.output], ref, ref32)
        rows.append({**case.info, **{key: values[m] for key, m in check.measures.items()}})
        failures += case_failures(check, case, values)
    prompts = check_media_prompts(export_dir, check, oracle, fp32, media_max_abs) if media else []
    failures += [f"{prompt.name}: {f}" for prompt, report in zip(check.prompts, prompts) for f in report.failures]
    conversation = media_conversation(export_dir, chat, check, oracle, fp32) if media and chat is not None else None
    failures += media_conversation_failures(conversation, math.inf if media_max_abs is None else media_max_abs)
    return TowerReport(tuple(failures), check.feature_bound, check.cases_key, tuple(rows), tuple(prompts),
                       dict(check.notes), conversation)


def measure(check: TowerCheck, output: np.ndarray, ref: torch.Tensor, ref32: torch.Tensor) -> dict[Measure, Any]:
    """The graph's ``output`` (one image's rows: [1, rows, hidden] or [rows, 1, hidden]) against
    HF's features ``ref`` (stored weights) and ``ref32`` (fp32), in HF's scale; errors are infinite
    when the shapes differ."""
    rows = output.reshape(-1, output.shape[-1])
    mnn = rows[:ref.shape[0]] if check.keeps_first_rows else rows
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
