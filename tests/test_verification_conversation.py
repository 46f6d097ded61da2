"""--verify holds a conversation: several chat turns in one runtime instance (KV cache kept, only
the new tokens prefilled), ``reset()`` and a new conversation, a history past the sliding window,
each turn against HF on the same history (llmexport/verification/conversation.py).

Unit tests pin the judging (which turn a failure names, the HF greedy answer read off one
teacher-forced pass, the report's JSON); the slow ones run every family's export through it and
show that a conversation the runtime renders differently from HF fails --verify with exit 4.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from llmexport import ExportOptions, export
from llmexport.cli import main
from llmexport.mnn.config import RuntimeProfile, profile_of
from llmexport.mnn.runtime import ChatTurnRun
from llmexport.mnn.tokenizer.stream import StreamModel
from llmexport.options import ChatThinking
from llmexport.quant.scheme import QuantScheme
from llmexport.results import (
    Bounds,
    ConversationCheck,
    ConversationTurn,
    LogitStats,
    RunComparison,
    StepStats,
    TokenizerCheck,
    VerifyReport,
)
from llmexport.source.checkpoint import Checkpoint
from llmexport.source.loading import open_architecture
from llmexport.tiny.gemma4_towers import build_tiny_multimodal
from llmexport.tiny.registry import TINY_BUILDERS
from llmexport.verification.conversation import (
    USER_TURNS,
    Conversations,
    conversation_failures,
    conversation_summary,
    oracle_side,
    reference_stop_ids,
    render,
    script,
    stream_bytes,
)
from llmexport.verification.verify import bounds_for_export, reference_pair, stored_tensors, summary_line

TURN_KEYS = ["conversation", "turn", "prompt_tokens", "kept_tokens", "prefilled_tokens", "past_window",
             "prompt_ids_match", "prompt_mismatch_at", "text_match", "streamed_text", "decoded_text",
             "text_difference", "oracle", "[exact_kernels]", "fp32"]


# --- the report ----------------------------------------------------------------------------------
def _stats(top1: float = 1.0, err: float = 1e-4, flipped: bool = False) -> LogitStats:
    step = StepStats(err, err / 10, 0.5 if flipped else 1.0, not flipped, 3 if flipped else 4, 4,
                     0.5 if flipped else 0.0, err if flipped else 0.0)
    return LogitStats(top1, err, err / 10, (step,))


def _turn(conversation=0, turn=0, mismatch=None, streamed="ab", decoded="ab", difference=(),
          greedy=((4, 5), (4, 5)), stats=None, exact=None) -> ConversationTurn:
    stats = stats or _stats()
    return ConversationTurn(conversation, turn, 30 + 10 * turn, 20 * turn, 30 - 10 * turn, turn > 0, mismatch,
                            streamed, decoded, difference, RunComparison.of(stats, *greedy), _stats(err=0.5), exact)


def _check(*turns: ConversationTurn, error: str | None = None) -> ConversationCheck:
    return ConversationCheck(8, 5, turns, error)


def test_turn_and_check_json_read_back_in_the_documented_order():
    exact = RunComparison.of(_stats(err=2e-3), (4,), (4,))
    check = _check(_turn(), _turn(0, 1, mismatch=12, streamed="a\x1c", decoded="a\ufffd",
                                  difference=("invalid_utf8",), exact=exact), error="conversation 2 turn 1: boom")
    data = json.loads(json.dumps(check.to_json()))
    assert list(data) == ["sliding_window", "planned_turns", "runtime_error", "top1_agreement", "max_abs_err", "turns"]
    for turn, has_kernels in zip(data["turns"], (False, True)):
        assert list(turn) == [k.strip("[]") for k in TURN_KEYS if has_kernels or not k.startswith("[")]
    assert data["turns"][1]["prompt_ids_match"] is False and data["turns"][1]["text_match"] is False
    assert ConversationCheck.from_json(data) == check
    report = VerifyReport(40, 3, TokenizerCheck(True, 7, ()), RuntimeProfile.EXACT,
                          RunComparison.of(_stats(), (1,), (1,)), _stats(), Bounds("exact", 0.2), ("x",),
                          conversation=check)
    written = report.to_json()
    assert list(written)[-5:] == ["towers", "conversation", "bounds", "failures", "passed"]
    assert VerifyReport.from_json(json.loads(json.dumps(written))) == report
    data["turns"][0]["text_match"] = False  # contradicts the texts
    with pytest.raises(ValueError, match="conversation 1 turn 1: text_match"):
        ConversationCheck.from_json(data)


def test_failures_name_the_turn_and_known_text_differences_pass():
    check = _check(
        _turn(0, 0, streamed="a\x1c", decoded="a\ufffd", difference=("invalid_utf8",)),  # known: passes
        _turn(0, 1, mismatch=31),
        _turn(0, 2, streamed="ab", decoded="ba", difference=("unexplained",)),
        _turn(1, 0, greedy=((4, 5, 1), (4, 5, 6, 7))),  # answers part at a token: reported, not failed
        _turn(1, 1, greedy=((4, 5), (4, 5, 6)), stats=_stats(0.0, 0.3, flipped=True)),
        error="conversation 2 turn 2: exact kernels: MNN's runtime failed (exit -11)")
    failures = conversation_failures(check, 0.2, None, None)
    assert not [f for f in failures if f.startswith("conversation 1 turn 1:")]
    assert "conversation 1 turn 2: the runtime's ids of the history differ from HF's chat template at token 31 " \
           "(of 40)" in failures
    assert any(f.startswith("conversation 1 turn 3: streamed text 'ab' != HF's decode 'ba'") for f in failures)
    assert not [f for f in failures if f.startswith("conversation 2 turn 1:")]  # greedy differs: reported only
    turn5 = [f for f in failures if f.startswith("conversation 2 turn 2:")]
    assert turn5[0] == "conversation 2 turn 2: the answers stop differently: [4, 5, 6] vs HF [4, 5]"
    assert "conversation 2 turn 2: step 0: top-1 3 != 4 (gap 0.5000 > the 0.3000 its two logits moved)" in turn5
    assert "conversation 2 turn 2: max abs logit error 0.30000 >= 0.2" in turn5
    assert failures[-1] == "conversation 2 turn 2: exact kernels: MNN's runtime failed (exit -11)"
    exact = _turn(0, 0, exact=RunComparison.of(_stats(err=0.5), (4,), (4,)))
    assert conversation_failures(_check(exact), 8.0, 1.0, 0.2) == [
        "conversation 1 turn 1: exact kernels: max abs logit error 0.50000 >= 0.2"]
    summary = conversation_summary(check)
    assert summary.startswith("conversation: 5/5 turns, runtime failed after 5, prompt ids 4/5, streamed text 3/5 "
                              "(+1 known differences), greedy 3/5")


class _Counter:
    """A fake family whose reference model continues every sequence with last token + 1 (mod 10)."""

    calls = 0

    def reference_logits(self, model, ids: torch.Tensor, first: int = 0) -> torch.Tensor:
        self.calls += 1
        return torch.nn.functional.one_hot((ids[first:] + 1) % 10, 10).float()


def _run(ids, answer, stopped=False) -> ChatTurnRun:
    return ChatTurnRun([], ids, 0, answer, stopped, [], np.zeros((len(answer), 10), np.float32))


@pytest.mark.parametrize("answer, stopped, stops, steps, greedy, calls", [
    ([3, 4, 5], False, (), 3, [3, 4, 5], 1),  # the runtime's answer is HF's: one forward
    ([3, 7, 8], False, (), 3, [3, 4], 1),  # HF's answer ends at its first other token
    ([3, 4, 5, 6], False, (5,), 4, [3, 4, 5], 1),  # HF stops at 5, the runtime goes on
    ([3, 4], True, (), 4, [3, 4, 5, 6], 3),  # the runtime stopped at 4, HF goes on (recomputing)
])
def test_hf_greedy_answer_is_read_off_one_teacher_forced_pass(answer, stopped, stops, steps, greedy, calls):
    arch = _Counter()
    reference = oracle_side(arch, None, _run([1, 2], answer, stopped), frozenset(stops), steps)  # type: ignore[arg-type]
    assert reference.greedy == greedy and arch.calls == calls
    assert reference.oracle_logits.shape == (len(answer), 10)
    # teacher-forced on the runtime's answer, whatever HF would have said
    assert list(reference.oracle_logits.argmax(1)) == [(t + 1) % 10 for t in [2] + answer[:-1]]


def test_a_nul_byte_the_binding_cuts_is_restored_from_the_tokenizer():
    """``tokenizer_decode`` returns a C string: the piece of byte token <0x00> comes back empty, but
    the runtime streams the byte (ArGeneration writes the std::string)."""
    table = ("a", "<0x00>", "b\u2581", "<0x41>")
    stream = StreamModel(table, table, byte_level=False)
    run = ChatTurnRun([], [1], 0, [0, 1, 2, 3, 1], False, [b"a", b"", b"b ", b"A", b""], np.zeros((5, 4)))
    assert stream_bytes(run, run.answer, stream) == b"a\x00b A\x00"
    assert stream_bytes(run, run.answer[:3], stream) == b"a\x00b "


def test_script_passes_the_sliding_window(tiny_gemma4):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_gemma4("e2b", text_only=True))
    assert script(tokenizer, 0) == [list(t) for t in USER_TURNS]
    long = script(tokenizer, 40)
    first = render(tokenizer, [{"role": "user", "content": long[1][0]}])
    assert len(first) >= 48 and long[1][0].startswith(USER_TURNS[1][0]) and long[0] == list(USER_TURNS[0])


# --- every family through MNN's runtime ------------------------------------------------------------
# model type -> (checkpoint, text bits, runtime profile)
FAMILIES = {
    "gemma4": ("gemma4", 4, RuntimeProfile.FAST),
    "gemma4_text": ("gemma4_text", 16, RuntimeProfile.FAST),
    "gemma4 towers": ("vision-audio-64", 8, RuntimeProfile.EXACT),
    "k2_horizon": ("k2_horizon", 4, RuntimeProfile.FAST),
    "llama": ("llama", 16, RuntimeProfile.FAST),
    "qwen3": ("qwen3", 8, RuntimeProfile.EXACT),
    "qwen3_moe": ("qwen3_moe", 4, RuntimeProfile.EXACT),
    "qwen2": ("qwen2", 16, RuntimeProfile.FAST),
    "mistral": ("mistral", 8, RuntimeProfile.EXACT),
    "ministral": ("ministral", 4, RuntimeProfile.FAST),
    "smollm3": ("smollm3", 16, RuntimeProfile.FAST),
    "gemma3_text": ("gemma3_text", 8, RuntimeProfile.EXACT),
    "gemma3": ("gemma3", 8, RuntimeProfile.FAST),
    "phi3": ("phi3", 16, RuntimeProfile.FAST),
    "lfm2": ("lfm2", 8, RuntimeProfile.EXACT),
    "lfm2_moe": ("lfm2_moe", 4, RuntimeProfile.FAST),
    "qwen3_5": ("qwen3_5", 8, RuntimeProfile.FAST),
    "qwen3_5_moe": ("qwen3_5_moe", 4, RuntimeProfile.EXACT),
    "qwen3_5_text": ("qwen3_5_text", 16, RuntimeProfile.FAST),
    "qwen3_5_moe_text": ("qwen3_5_moe_text", 8, RuntimeProfile.EXACT),
    "qwen3_vl": ("qwen3_vl", 4, RuntimeProfile.FAST),
    "qwen3_vl_moe": ("qwen3_vl_moe", 4, RuntimeProfile.EXACT),
}


def test_every_registered_family_holds_a_conversation():
    assert set(TINY_BUILDERS) <= {checkpoint for checkpoint, _, _ in FAMILIES.values()}


def _conversation(out, path, bits: int, trust: bool) -> tuple[ConversationCheck, Bounds]:
    """What verify_export does for the conversation, without the single-prompt and tower checks."""
    from transformers import AutoTokenizer

    arch = open_architecture(Checkpoint.open(path))
    tokenizer = AutoTokenizer.from_pretrained(path)
    window = int(arch.llm_config().get("sliding_window") or 0)
    bounds = bounds_for_export({bits}, profile_of(json.loads((out / "config.json").read_text())))
    chat = Conversations.run(out, tokenizer, window, bounds.kernels_max_abs_err is not None)
    oracle, fp32 = reference_pair(arch, stored_tensors(out, arch), trust_remote_code=trust)
    chat.add_oracle(arch, oracle, reference_stop_ids(path, tokenizer, arch))
    chat.add_fp32(arch, fp32)
    return chat.check(tokenizer, StreamModel.from_folder(path)), bounds


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_chats_like_hf(tmp_path, family):
    checkpoint, bits, profile = FAMILIES[family]
    path = build_tiny_multimodal(tmp_path / "model", checkpoint) if checkpoint.startswith("vision") \
        else TINY_BUILDERS[checkpoint](tmp_path / "model", 0)
    out = tmp_path / "out"
    export(path, out, ExportOptions(quant=QuantScheme(bits, 64), runtime_profile=profile))
    check, bounds = _conversation(out, path, bits, trust=checkpoint == "k2_horizon")
    print(f"\n{family} q{bits} {profile.value}: {conversation_summary(check)}")
    for turn in check.turns:
        print(f"  {turn.label}: prompt {turn.prompt_tokens}, kept {turn.kept_tokens}, top-1 "
              f"{turn.oracle.top1_agreement:.0%}, max |dlogit| {turn.oracle.max_abs_err:.2e}"
              + (f", exact kernels {turn.exact_kernels.max_abs_err:.2e}" if turn.exact_kernels else "")
              + f", fp32 {turn.fp32.max_abs_err:.2e}, text {list(turn.text_difference) or 'equal'}")
    assert check.runtime_error is None and len(check.turns) == check.planned_turns == 5
    assert [t.label for t in check.turns] == ["conversation 1 turn 1", "conversation 1 turn 2",
                                              "conversation 1 turn 3", "conversation 2 turn 1",
                                              "conversation 2 turn 2"]
    assert all(t.prompt_ids_match for t in check.turns)
    first_turns = [t for t in check.turns if t.turn == 0]
    later = [t for t in check.turns if t.turn > 0]
    assert all(t.kept_tokens == 0 for t in first_turns)  # the second one comes after reset()
    # the history stays in the cache: only the new message (and a retokenized answer tail) is
    # prefilled; a recurrent state is never cut back, so there a history that does not extend the
    # cached ids is replayed up to the common prefix after reset() and the turn's prefill continues
    # it (mnn/runtime.py _rewind; docs/output-format.md)
    assert all(0 < t.kept_tokens and t.prefilled_tokens < t.prompt_tokens for t in later)
    assert all(t.kept_tokens + t.prefilled_tokens == t.prompt_tokens for t in check.turns)
    window = int(json.loads((out / "llm_config.json").read_text()).get("sliding_window", 0))
    assert check.sliding_window == window
    assert any(t.past_window for t in check.turns) == bool(window)  # the long turns run past any window
    assert bool(window) == (family.startswith("gemma") or family in ("qwen2", "mistral", "ministral"))
    assert (check.turns[0].exact_kernels is not None) == (bounds.kernels_max_abs_err is not None)
    assert conversation_failures(check, bounds.max_abs_err, bounds.mean_abs_err, bounds.kernels_max_abs_err) == []
    assert not any("unexplained" in t.text_difference for t in check.turns)
    if bounds.kernels_max_abs_err is None:  # exact kernels or fp16 records: HF's greedy answers exactly
        assert all(t.oracle.greedy_match and t.oracle.top1_agreement == 1.0 for t in check.turns)
    else:
        assert all(t.exact_kernels is not None and t.exact_kernels.greedy_match for t in check.turns)


@pytest.mark.slow
def test_verify_fails_a_conversation_whose_history_the_runtime_renders_differently(tiny_decoder, tmp_path,
                                                                                   monkeypatch):
    """An export whose chat template renders earlier answers differently from HF's: one prompt (the
    single-prompt check) agrees, the second turn's history does not -- exit 4, naming the turn."""
    path = tiny_decoder("qwen3")
    family = type(open_architecture(Checkpoint.open(path)))
    original = family.llm_config
    content = "{{ message['content'] }}"

    def broken(self):
        config = original(self)
        template = config["jinja"]["chat_template"]
        assert content in template
        config["jinja"]["chat_template"] = template.replace(
            content, content + "{% if message['role'] == 'assistant' %} (edited){% endif %}")
        return config

    monkeypatch.setattr(family, "llm_config", broken)
    dst = tmp_path / "out"
    result = CliRunner().invoke(main, ["--path", str(path), "--dst_path", str(dst), "--quant_bit", "16", "--verify"])
    assert result.exit_code == 4, result.output
    assert "conversation 1 turn 2: the runtime's ids of the history differ from HF's chat template" in result.output
    assert "conversation 1 turn 1:" not in result.output and "step " not in result.output  # the logits agree
    assert not dst.exists()  # a failed verification keeps the export out of place


@pytest.mark.slow
def test_verify_json_holds_the_conversation(tiny_decoder, tmp_path):
    from llmexport.verification.verify import verify_export

    path, out = tiny_decoder("llama3"), tmp_path / "out"
    export(path, out, ExportOptions(quant=QuantScheme(16, 64)))
    report = verify_export(out, path, steps=8)
    assert report.passed, report.failures
    assert summary_line(report).endswith("; " + conversation_summary(report.conversation))
    written = VerifyReport.read(out / "verify.json")
    assert written == report and written.conversation is not None and len(written.conversation.turns) == 5


@pytest.mark.slow
@pytest.mark.parametrize("thinking", [ChatThinking.DEFAULT, ChatThinking.ON])
def test_real_gemma4_template_chats_like_hf(tiny_gemma4, tmp_path, thinking):
    """The checkpoint's real Gemma4 chat template (derived for the runtime's engine), with thinking
    as exported (``--chat_thinking``): every turn's history renders and tokenizes as HF's, and the
    conversation passes, on the per-layer-embedding shape."""
    import shutil

    from transformers import AutoTokenizer

    from real_vocab import gemma4_chat_template

    path = Path(shutil.copytree(tiny_gemma4("e2b"), tmp_path / "model"))
    (path / "chat_template.jinja").write_text(gemma4_chat_template(), encoding="utf-8")
    out = tmp_path / "out"
    export(path, out, ExportOptions(quant=QuantScheme(16, 64), chat_thinking=thinking))
    jinja = json.loads((out / "llm_config.json").read_text())["jinja"]
    assert jinja.get("context", {}) == thinking.template_context()
    check, bounds = _conversation(out, path, 16, trust=False)
    assert check.runtime_error is None and len(check.turns) == 5
    assert all(t.prompt_ids_match for t in check.turns), [t.prompt_mismatch_at for t in check.turns]
    assert conversation_failures(check, bounds.max_abs_err, bounds.mean_abs_err, bounds.kernels_max_abs_err) == []
    assert all(t.oracle.greedy_match and t.oracle.top1_agreement == 1.0 for t in check.turns)
    # thinking off (the template's default) ends the generation prompt with an empty thought channel
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = tokenizer.decode(render(tokenizer, [{"role": "user", "content": "Hi"}], jinja.get("context")))
    assert prompt.endswith("<|channel>thought\n<channel|>") == (thinking is not ChatThinking.ON)
