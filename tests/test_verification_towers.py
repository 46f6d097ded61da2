"""Tower verification (llmexport/verification/towers.py) over any TowerCheck, and the Gemma4
towers' checks on the tiny checkpoints: what verify.json's tower sections are made of, without MNN
(the runs in MNN: tests/test_vision_export.py, tests/test_audio_export.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import llmexport.verification.towers as vt
from llmexport.models.base import Tower
from llmexport.models.gemma4.tower_checks import PROMPT_HEAD
from llmexport.models.tower_check import FeatureCase, Measure, PromptCase, TowerCheck
from llmexport.results import MediaPromptReport, TowerReport
from llmexport.source.checkpoint import Checkpoint
from llmexport.source.loading import open_architecture
from llmexport.spec import LinearRole, LinearSource, LinearSpec
from llmexport.tiny.gemma4_towers import build_tiny_multimodal
from llmexport.tiny.tokenizer import SPECIAL_TOKENS

ALL_MEASURES = {m.value: m for m in Measure}


def _check(**fields) -> TowerCheck:
    base = dict(output="out", cases=(), features=lambda model: [], measures=ALL_MEASURES, cases_key="cases",
                feature_bound=1e-3, prompts=(), prompt_logits=lambda model, prompt: None, stop_ids=frozenset(),
                bos_id=2)
    return TowerCheck(**{**base, **fields})


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), padding=st.integers(0, 4), hidden=st.integers(1, 5),
       scale=st.sampled_from([1.0, 2.0 ** 40, 39.25 / 8]), seed=st.integers(0, 2 ** 16))
def test_padded_output_is_compared_on_hfs_rows_in_hfs_scale(rows, padding, hidden, scale, seed):
    rng = np.random.default_rng(seed)
    ref = torch.from_numpy(rng.normal(size=(rows, hidden)).astype(np.float32))
    out = np.concatenate([ref.numpy() * scale, rng.normal(size=(padding, hidden)).astype(np.float32) * 1e3])[None]
    values = vt.measure(_check(output_scale=scale, keeps_first_rows=True), out, ref, ref * 2)
    assert values[Measure.ROWS] == values[Measure.MNN_ROWS] == rows
    assert values[Measure.REL_ERR] < 1e-6 and values[Measure.MAX_ABS_ERR] < 1e-5 * max(1.0, float(ref.abs().max()))
    assert values[Measure.REL_ERR_FP32] == pytest.approx(0.5, rel=1e-5)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), extra=st.integers(-1, 2).filter(bool), seed=st.integers(0, 2 ** 16))
def test_a_row_count_differing_from_hfs_is_an_infinite_error(rows, extra, seed):
    ref = torch.from_numpy(np.random.default_rng(seed).normal(size=(rows, 3)).astype(np.float32))
    out = np.zeros((1, max(rows + extra, 0), 3), np.float32)
    check = _check()
    values = vt.measure(check, out, ref, ref)
    assert values[Measure.MNN_ROWS] == rows + extra and values[Measure.ROWS] == rows
    assert values[Measure.REL_ERR] == values[Measure.MAX_ABS_ERR] == values[Measure.REL_ERR_FP32] == math.inf
    failures = vt.case_failures(check, FeatureCase("clip of 7 samples", {}, {}), values)
    assert failures == ["clip of 7 samples: relative error inf >= 0.001"]


class _Reference(nn.Module):
    """HF stand-in: a tower linear (checkpoint names = parameter names) and its features x @ W^T + b."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.proj = nn.Linear(4, 3)


class _Tower(Tower):
    name = "probe"

    def linears(self):
        return [LinearSpec("probe.proj", 4, 3, LinearRole.MLP, True)]

    def linear_weight(self, name):
        raise AssertionError("verification reads the stored weights, never the checkpoint's")

    def linear_source(self, name):
        return LinearSource("proj.weight", None, "proj.bias")

    def build_graph(self):
        raise AssertionError

    def graph_inputs(self):
        raise AssertionError

    def check(self):
        raise AssertionError("the test hands its own check")


def test_section_layout_and_the_oracle_against_the_fp32_reference(tmp_path, monkeypatch):
    """The section compares the graph with the oracle (HF carrying the stored weights: the graph
    computed with those agrees exactly, the fp32 HF does not) and keeps its layout: passed,
    failures, notes, feature_bound, the cases under ``cases_key``, prompts."""
    x = torch.randn(2, 4)
    oracle, fp32 = _Reference(0), _Reference(1)
    graph = oracle.proj(x).detach().numpy()
    monkeypatch.setattr(vt, "run_module", lambda model, feeds, outputs: [{"embeds": graph[None]} for _ in feeds])
    monkeypatch.setattr(vt, "check_media_prompts", lambda folder, check, oracle, fp32, max_abs: [
        MediaPromptReport(2, True, (1,), (2,), ("greedy tokens differ",), label=p.label) for p in check.prompts])
    prompt = PromptCase("one", "probe prompt one", {"input_ids": torch.tensor([[2, 5]])}, lambda folder: "")
    check = _check(output="embeds", cases=(FeatureCase("case a", {"x": x.numpy()}, {"size": 1}),
                                           FeatureCase("case b", {"x": x.numpy()}, {"size": 2})),
                   features=lambda model: [model.proj(x).detach()] * 2, cases_key="probes",
                   measures={"tokens": Measure.ROWS, "rel_err": Measure.REL_ERR, "rel_err_fp32": Measure.REL_ERR_FP32},
                   prompts=(prompt,), prompt_logits=lambda model, p: lambda ids: torch.eye(8)[ids],
                   notes={"scale_note": 7})
    report = vt.verify_tower(_Tower(), tmp_path, oracle, fp32, check)
    section = report.to_json()
    assert list(section) == ["passed", "failures", "scale_note", "feature_bound", "probes", "prompts", "conversation"]
    assert section["conversation"] is None  # run only with the architecture (``verify_towers``)
    assert [list(row) for row in section["probes"]] == [["size", "tokens", "rel_err", "rel_err_fp32"]] * 2
    assert all(row["rel_err"] < 1e-6 and row["rel_err_fp32"] > 0.1 and row["tokens"] == 2 for row in report.cases)
    assert report.failures == ("probe prompt one: greedy tokens differ",) and not report.passed
    assert section["prompts"][0]["label"] == "one" and TowerReport.from_json(section) == report

    # with the architecture, the media conversation: its failures are the tower's, its check the section's last key
    from llmexport.results import ConversationCheck

    chat = ConversationCheck(0, 3, (), "conversation 1 turn 1: the runtime crashed")
    monkeypatch.setattr(vt, "media_conversation", lambda folder, arch, check, oracle, fp32: chat)
    report = vt.verify_tower(_Tower(), tmp_path, oracle, fp32, check, media_max_abs=0.005, chat=object())
    assert report.failures[-1] == "media conversation: conversation 1 turn 1: the runtime crashed"
    section = report.to_json()
    assert list(section)[-1] == "conversation" and TowerReport.from_json(section).conversation == chat


@pytest.fixture(scope="module")
def towers(tmp_path_factory):
    path = build_tiny_multimodal(tmp_path_factory.mktemp("vision-audio"), "vision-audio-64")
    arch = open_architecture(Checkpoint.open(path))
    return {tower.name: tower for tower in arch.towers()}


@pytest.mark.parametrize("name,cases_key,measures,prompt_info,notes", [
    ("visual", "images", ["soft_tokens", "rel_err", "max_abs_err", "rel_err_fp32"],
     ["image", "processed", "soft_tokens"], ["output_scale", "marks_images"]),
    ("audio", "clips", ["tokens", "mnn_tokens", "rel_err", "rel_err_fp32"], ["samples", "tokens", "frames"], []),
])
def test_gemma4_tower_checks_describe_todays_report(towers, tmp_path, name, cases_key, measures, prompt_info, notes):
    """Each case feeds the tower graph's inputs and reads its output; the HF features, one per case,
    come from the HF model; each prompt's ids hold the medium's soft tokens and its runtime text
    is the same prompt with the medium saved for the runtime."""
    tower = towers[name]
    check = tower.check()
    inputs = tower.graph_inputs()
    assert check.output in inputs.output_names and check.cases_key == cases_key
    assert list(check.measures) == measures and list(check.notes) == notes and check.feature_bound == 1e-3
    assert len(check.cases) == 3 and all(list(case.feeds) == inputs.names for case in check.cases)
    assert [list(case.info) for case in check.cases] == [["size", "processed"] if name == "visual" else
                                                         ["samples", "frames"]] * 3
    assert check.bos_id == SPECIAL_TOKENS["bos"][1] and SPECIAL_TOKENS["image"][1] in check.stop_ids
    (prompt,) = check.prompts
    media = SPECIAL_TOKENS["image" if name == "visual" else "audio"][1]
    assert list(prompt.info) == prompt_info and prompt.ids.count(media) > 0
    assert prompt.info["soft_tokens" if name == "visual" else "tokens"] == prompt.ids.count(media)
    text = prompt.runtime_text(tmp_path)
    assert text.startswith(PROMPT_HEAD) and len(list(tmp_path.iterdir())) == 1
    assert str(next(tmp_path.iterdir())) in text


def test_the_media_conversation_renders_hfs_expanded_medium_and_stops_where_ids_leave_the_prompt():
    """HF's text for a prompt's medium spans its media tokens and the added marks next to them
    (not the text around); a chat turn whose ids do not extend the prompt's ends the runtime's run
    with the reason; a skipped conversation round-trips through the tower section."""
    from llmexport.mnn.runtime import ChatRun, ChatTurnRun
    from llmexport.verification.media_chat import extending, hf_media_text, media_conversation_summary

    class Tokenizer:
        added_tokens_decoder = {7: "<b>", 8: "<e>", 9: "<p>"}

        def decode(self, ids, skip_special_tokens):
            assert skip_special_tokens is False
            return "".join(self.added_tokens_decoder.get(i, f"[{i}]") for i in ids)

    prompt = PromptCase("one", "image prompt one", {"input_ids": torch.tensor([[2, 5, 7, 9, 9, 8, 30, 31]])},
                        lambda folder: "", question="Q")
    assert hf_media_text(Tokenizer(), prompt, frozenset({9})) == "<b><p><p><e>"
    turn = lambda ids: ChatTurnRun([], ids, 0, [1], False, [b"x"], np.zeros((1, 4)))  # noqa: E731
    good, bad = turn(prompt.ids + [40]), turn([2, 5, 7, 9, 8])
    assert extending(ChatRun([good, good]), prompt).turns == [good, good]
    cut = extending(ChatRun([good, bad, good]), prompt)
    assert cut.turns == [good] and cut.error == "the runtime's ids differ from image prompt one's (HF's processor) " \
        "at token 4 of 8"
    report = TowerReport((), 1e-3, "cases", (), (), {}, "skipped: why")
    assert TowerReport.from_json(report.to_json()) == report
    assert media_conversation_summary("visual", report) == "; visual media conversation skipped: why"
