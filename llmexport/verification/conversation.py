"""Conversations: MNN's runtime keeping its KV cache across chat turns, next to HF.

A chat app keeps one runtime instance: each turn it renders the whole history with the runtime's
chat template (``apply_chat_template``), tokenizes it with the runtime's tokenizer, prefills only
what the KV cache lacks and generates greedily (MNN 3.6.1: ``Llm::generate`` after ``generate_init``
with ``reuse_kv``; ``Llm::reset`` between conversations; see mnn/runtime.py ``run_chat``; an export
with recurrent state, llm_config.json ``recurrent_state``, is never erased to a shorter history: it
is reset and the whole history prefilled). Its answers, as it streams them, are the history of the
later turns -- on both sides.

HF is given the same history each turn: it renders it with the checkpoint's chat template (the
ids are compared with the runtime's), and the stored-weights oracle and the fp32 model are
teacher-forced on the runtime's context and answer, one forward per turn, so the statistics
compare logits on identical tokens however the answers go. HF's greedy answer is the oracle's
argmax path on that history up to its first token that differs from the runtime's (one forward
more per step only when the runtime stopped where HF goes on). The streamed text is compared
with HF's decode of the same ids. The script: three turns, ``reset()``, two turns of which the
second's history passes the sliding window (docs/verification.md#conversations).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, cast

import numpy as np
import torch
from torch import nn

from llmexport.mnn.config import EXACT_KERNELS
from llmexport.mnn.runtime import ChatRun, ChatTurnRun, common_prefix_length, run_chat
from llmexport.mnn.tokenizer.stream import StreamModel, streamed_text_difference
from llmexport.models.base import Architecture
from llmexport.models.tower_check import PromptLogits
from llmexport.results import ConversationCheck, ConversationTurn, RunComparison
from llmexport.verification.logits import compare_logits, run_failures
from llmexport.verification.media import greedy_along, reference_greedy

#: greedy steps per answer
ANSWER_STEPS = 8
#: the user messages of each conversation (``reset()`` between them); the first message of the
#: second conversation is repeated until its prompt passes the sliding window (``script``)
USER_TURNS: tuple[tuple[str, ...], ...] = (
    ("Hello! Who are you?", "Tell me about the sea, briefly.", "Und jetzt auf Deutsch, bitte."),
    ("Read this note: the meeting moves to Friday, room 4. ", "What did the note say?"),
)


def render(tokenizer, messages: list[dict[str, str]], context: dict[str, Any] | None = None) -> list[int]:
    """HF's ids of a history: the checkpoint's chat template, with the generation prompt and the
    template variables the export sets (llm_config.json ``jinja.context``, e.g. ``enable_thinking``)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                        **(context or {}))
    return [int(i) for i in (ids["input_ids"] if isinstance(ids, dict) else ids)]


def script(tokenizer, window: int) -> list[list[str]]:
    """``USER_TURNS``, the second conversation's first message long enough that the history of its
    second turn passes a sliding window of ``window`` tokens."""
    first, *rest = USER_TURNS[1]
    message = first
    while window and len(render(tokenizer, [{"role": "user", "content": message}])) < window + 8:
        message += first
    return [list(USER_TURNS[0]), [message, *rest]]


def reference_stop_ids(model_path: Path, tokenizer, arch: Architecture) -> frozenset[int]:
    """Where HF's chat stops: generation_config.json's eos ids, the tokenizer's eos and the
    family's end-of-turn tokens that the vocabulary has."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    for value in (eos, tokenizer.eos_token_id):
        ids.update([value] if isinstance(value, int) else value or [])
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in arch.end_of_turn_tokens() if t in vocab)
    return frozenset(ids)


@dataclass
class TurnReference:
    """HF on one runtime turn's history: the oracle's greedy answer (``greedy_ref``) and the
    teacher-forced logits of the oracle and the fp32 model on the runtime's context and answer."""

    greedy: list[int]
    oracle_logits: np.ndarray
    fp32_logits: np.ndarray | None = field(default=None, repr=False)


def text_logits(arch: Architecture, model: nn.Module) -> PromptLogits:
    """HF's logits of a text model for ids from a position on (``Architecture.reference_logits``)."""
    return lambda ids, first=0: arch.reference_logits(model, torch.tensor(ids), first)


def oracle_side(arch: Architecture, model: nn.Module, turn: ChatTurnRun, stop_ids: frozenset[int],
                steps: int = ANSWER_STEPS, forward: PromptLogits | None = None) -> TurnReference:
    """One forward over the runtime's context and answer gives the oracle's logits at every answer
    step; its greedy answer follows its argmax along the runtime's (``greedy_along``), and goes on
    (recomputing the sequence) only past the runtime's stop (``forward``: HF's logits of ``model``
    for the turn's ids; None: ``text_logits``)."""
    forward = forward or text_logits(arch, model)
    logits = turn_logits(forward, turn)
    greedy = greedy_along(logits, turn.answer, stop_ids)
    if greedy == turn.answer and greedy[-1] not in stop_ids and len(greedy) < steps:
        # the runtime stopped; HF does not stop there
        more, _ = reference_greedy(lambda ids: forward(ids, len(ids) - 1), turn.ids + greedy, steps - len(greedy),
                                   stop_ids)
        greedy += more
    return TurnReference(greedy, logits)


def turn_logits(forward: PromptLogits, turn: ChatTurnRun) -> np.ndarray:
    """HF's logits at every answer step, teacher-forced on the runtime's context and answer."""
    context = turn.ids + turn.answer[:-1]
    return forward(context, len(turn.ids) - 1).numpy()


@dataclass
class Conversations:
    """The runtime's conversation runs (the shipped config.json; ``kernels``: MNN's exact kernels,
    for a fast export with quantized linears) and HF on each of their turns, filled in while the
    oracle (``add_oracle``) and the fp32 model (``add_fp32``) are loaded.

    A conversation with a medium (llmexport/verification/media_chat.py) sets ``forward``: HF's
    logits of a model for the turns' ids (None: ``text_logits``), and ``media``: the runtime's
    media tag in the messages and HF's text for the medium, put in its place before HF renders
    the history."""

    planned: list[tuple[int, int]]  # (conversation, turn) of each turn of the script
    window: int
    shipped: ChatRun
    kernels: ChatRun | None
    context: dict[str, Any]  # the chat template's variables the export sets
    oracle: list[TurnReference] = field(default_factory=list)
    kernels_oracle: list[TurnReference] = field(default_factory=list)
    forward: Callable[[nn.Module], PromptLogits] | None = None
    media: tuple[str, str] | None = None

    @classmethod
    def run(cls, export_dir: Path, tokenizer, window: int, exact_kernels: bool) -> Conversations:
        users = script(tokenizer, window)
        shipped = run_chat(export_dir, users, ANSWER_STEPS)
        kernels = run_chat(export_dir, users, ANSWER_STEPS, config=EXACT_KERNELS) if exact_kernels else None
        return cls.of(export_dir, users, window, shipped, kernels)

    @classmethod
    def of(cls, export_dir: Path, users: list[list[str]], window: int, shipped: ChatRun,
           kernels: ChatRun | None = None) -> Conversations:
        """The conversations of ``users`` as runs made them (``chat_call``: on any machine)."""
        planned = [(c, t) for c, messages in enumerate(users) for t in range(len(messages))]
        jinja = json.loads((export_dir / "llm_config.json").read_text()).get("jinja") or {}
        return cls(planned, window, shipped, kernels, dict(jinja.get("context") or {}))

    def _forward(self, arch: Architecture, model: nn.Module) -> PromptLogits:
        return text_logits(arch, model) if self.forward is None else self.forward(model)

    def add_oracle(self, arch: Architecture, model: nn.Module, stop_ids: frozenset[int]) -> None:
        forward = self._forward(arch, model)
        self.oracle = [oracle_side(arch, model, t, stop_ids, forward=forward) for t in self.shipped.turns]
        if self.kernels is not None:
            self.kernels_oracle = [oracle_side(arch, model, t, stop_ids, forward=forward) for t in self.kernels.turns]

    def add_fp32(self, arch: Architecture, model: nn.Module) -> None:
        forward = self._forward(arch, model)
        for turn, reference in zip(self.shipped.turns, self.oracle):
            reference.fp32_logits = turn_logits(forward, turn)

    def hf_messages(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        """``messages`` as HF renders them: the runtime's media tag replaced by HF's text for it."""
        if self.media is None:
            return messages
        tag, text = self.media
        return [{**m, "content": m["content"].replace(tag, text)} for m in messages]

    def check(self, tokenizer, stream: StreamModel) -> ConversationCheck:
        """Per turn: the runtime's ids of the history against HF's rendering, answers, streamed text
        against HF's decode of the same ids (a difference classified by ``stream``), teacher-forced
        logits; the exact-kernels run on its logits and answers only."""
        turns = []
        for i, (run, ref) in enumerate(zip(self.shipped.turns, self.oracle)):
            answer = run.answer[:-1] if run.stopped else run.answer
            raw = stream_bytes(run, answer, stream)
            streamed = raw.decode("utf-8", errors="replace")
            decoded = cast(str, tokenizer.decode(answer, skip_special_tokens=True))
            difference = streamed_text_difference(stream, answer, raw, decoded, skip_special_tokens=True)
            kinds = () if streamed == decoded else ("unexplained",) if difference is None else difference.kinds
            exact = None
            if self.kernels is not None and i < len(self.kernels_oracle):
                k, kref = self.kernels.turns[i], self.kernels_oracle[i]
                exact = RunComparison.of(compare_logits(k.logits, kref.oracle_logits), kref.greedy, k.answer)
            assert ref.fp32_logits is not None, "add_fp32 first"
            hf_ids = render(tokenizer, self.hf_messages(run.messages), self.context)
            conversation, number = self.planned[i]
            turns.append(ConversationTurn(
                conversation, number, len(hf_ids), run.kept, len(run.ids) - run.kept,
                bool(self.window) and run.kept > self.window, _first_difference(run.ids, hf_ids), streamed, decoded,
                kinds, RunComparison.of(compare_logits(run.logits, ref.oracle_logits), ref.greedy, run.answer),
                compare_logits(run.logits, ref.fp32_logits), exact))
        return ConversationCheck(self.window, len(self.planned), tuple(turns), self._error())

    def _error(self) -> str | None:
        """The first turn a run did not complete, and why."""
        for name, run in (("", self.shipped), ("exact kernels: ", self.kernels)):
            if run is not None and len(run.turns) < len(self.planned):
                conversation, turn = self.planned[len(run.turns)]
                return f"conversation {conversation + 1} turn {turn + 1}: {name}{run.error or 'no result'}"
        return None


def stream_bytes(run: ChatTurnRun, answer: list[int], stream: StreamModel) -> bytes:
    """The bytes the runtime streamed for ``answer``: its pieces, where the binding cut one at a NUL
    byte completed from the tokenizer's own piece (``stream.piece_bytes``)."""
    out = []
    for piece, token in zip(run.pieces, answer):
        full = stream.piece_bytes(token)
        out.append(full if b"\x00" in full and full.split(b"\x00")[0] == piece else piece)
    return b"".join(out)


def _first_difference(a: list[int], b: list[int]) -> int | None:
    n = common_prefix_length(a, b)
    return None if n == len(a) == len(b) else n


def conversation_failures(check: ConversationCheck, max_abs: float, mean_abs: float | None,
                          kernels_max_abs: float | None) -> list[str]:
    """The failures of the conversation check, each naming its turn: a runtime failure, a history
    the runtime renders or tokenizes differently from HF, streamed text that no known difference
    explains, answers that stop at different places, teacher-forced top-1 flips or errors over the
    bounds (those of the single-prompt check)."""
    failures = []
    for turn in check.turns:
        label = f"{turn.label}: "
        if not turn.prompt_ids_match:
            failures.append(f"{label}the runtime's ids of the history differ from HF's chat template at token "
                            f"{turn.prompt_mismatch_at} (of {turn.prompt_tokens})")
        if "unexplained" in turn.text_difference:
            failures.append(f"{label}streamed text {turn.streamed_text!r} != HF's decode {turn.decoded_text!r}")
        for name, run in (("", turn.oracle), ("exact kernels: ", turn.exact_kernels)):
            if run is not None and _stops_differently(run):
                failures.append(f"{label}{name}the answers stop differently: {list(run.greedy_mnn)} vs HF "
                                f"{list(run.greedy_ref)}")
        failures += run_failures(label, turn.oracle, max_abs, mean_abs)
        if turn.exact_kernels is not None and kernels_max_abs is not None:
            failures += run_failures(f"{label}exact kernels: ", turn.exact_kernels, kernels_max_abs, None)
    if check.runtime_error is not None:
        failures.append(check.runtime_error)
    return failures


def _stops_differently(run: RunComparison) -> bool:
    """One side stopped where the other went on, with the same tokens up to there."""
    a, b = run.greedy_ref, run.greedy_mnn
    n = min(len(a), len(b))
    return len(a) != len(b) and a[:n] == b[:n]


def conversation_summary(check: ConversationCheck) -> str:
    turns, n = check.turns, len(check.turns)
    prompts = sum(t.prompt_ids_match for t in turns)
    texts = sum(t.text_match for t in turns)
    known = sum(bool(t.text_difference) and "unexplained" not in t.text_difference for t in turns)
    greedy = sum(t.oracle.greedy_match for t in turns)
    fp32 = max((t.fp32.max_abs_err for t in turns), default=0.0)
    failed = f", runtime failed after {n}" if check.runtime_error else ""
    kernels = [t.exact_kernels.max_abs_err for t in turns if t.exact_kernels is not None]
    exact = f"; exact kernels {max(kernels):.2e}" if kernels else ""
    return (f"conversation: {n}/{check.planned_turns} turns{failed}, prompt ids {prompts}/{n}, streamed text "
            f"{texts}/{n}{f' (+{known} known differences)' if known else ''}, greedy {greedy}/{n}, "
            f"top-1 {check.top1_agreement:.0%}, max |dlogit| {check.max_abs_err:.2e} (fp32 HF {fp32:.2e}{exact})")
