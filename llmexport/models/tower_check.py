"""What verification checks of a multimodal tower, described by the tower and run elsewhere.

A ``Tower`` (models/base.py) returns a ``TowerCheck``: plain data and pure-torch functions of a
loaded HF model. It never runs MNN nor reads the export back; llmexport/verification/towers.py
does that, the same way for every tower: each ``FeatureCase`` through the tower's graph alone
against ``features`` of HF carrying the stored weights (and of the fp32 HF, reported), each
``PromptCase`` through MNN's runtime against ``prompt_logits`` of the same two models
(llmexport/verification/media.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn


class Measure(str, Enum):
    """What verification measures per tower-alone case (``TowerCheck.measures`` names them)."""

    ROWS = "rows"  # soft tokens in HF's features
    MNN_ROWS = "mnn_rows"  # soft tokens in the graph's output
    REL_ERR = "rel_err"  # max |mnn - hf| / max |hf|, HF carrying the stored weights (judged)
    MAX_ABS_ERR = "max_abs_err"  # max |mnn - hf|, same HF
    REL_ERR_FP32 = "rel_err_fp32"  # relative error against the fp32 HF (reported)


@dataclass(frozen=True)
class FeatureCase:
    """One run of the tower's graph alone on HF's exact inputs."""

    name: str  # names the case in a failure ("image [300, 300]")
    feeds: dict[str, np.ndarray]  # graph input name -> value
    info: dict[str, Any]  # report fields describing the input, before the measurements


@dataclass(frozen=True)
class PromptCase:
    """One media+text prompt: HF's processor outputs for the text with the medium's placeholder,
    and the runtime's prompt text, whose medium ``runtime_text`` saves into a given folder.

    ``question``: the user's words after the medium, up to the end of the user's turn; the image
    conversation (llmexport/verification/media_chat.py) opens with the medium and these words, so
    that its first turn's ids are the prompt's (``TowerCheck.prompt_logits`` then gives HF's
    logits for the whole conversation: the prompt's ids extended by the later turns)."""

    label: str  # the report's label ("317x451")
    name: str  # names the prompt in a failure ("image prompt 317x451")
    inputs: dict[str, torch.Tensor]
    runtime_text: Callable[[Path], str]
    info: dict[str, Any] = field(default_factory=dict)  # report fields appended to the comparison
    question: str = ""

    @property
    def ids(self) -> list[int]:
        return self.inputs["input_ids"][0].tolist()


#: a prompt's logits [positions, vocab] for ids extending it, from a position on (``first``, default 0):
#: generated ids, or whole later chat turns (text: HF's ``mm_token_type_ids`` 0 there, positions its own)
PromptLogits = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class TowerCheck:
    """Everything verification needs to judge one exported tower, as data.

    The graph's ``output`` equals HF's ``features`` times ``output_scale``; with
    ``keeps_first_rows`` the graph also emits padding rows, of which the runtime keeps as many
    as HF has soft tokens (those are compared), otherwise every row is a soft token and the
    counts must agree. A relative error at or above ``feature_bound`` fails.
    """

    output: str
    cases: tuple[FeatureCase, ...]
    features: Callable[[nn.Module], list[torch.Tensor]]  # HF's soft tokens [n, hidden] per case
    measures: dict[str, Measure]  # report key -> measurement, in report order
    cases_key: str  # report key of the per-case list ("images")
    feature_bound: float
    prompts: tuple[PromptCase, ...]
    prompt_logits: Callable[[nn.Module, PromptCase], PromptLogits]
    stop_ids: frozenset[int]  # generated ids that end a prompt's comparison (media tokens)
    bos_id: int | None  # the runtime's prompt must hold it exactly once (None: a tokenizer without BOS)
    output_scale: float = 1.0
    feature_columns: int | None = None  # the rows' first columns are the features; the rest is a token tail
    keeps_first_rows: bool = False
    notes: dict[str, Any] = field(default_factory=dict)  # section fields reported as they are
