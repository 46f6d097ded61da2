"""Gemma4's real chat template: what MNN 3.6.1's runtime renders versus transformers.

The real template (``tokenizer.chat_template`` of llama.cpp's ``ggml-vocab-gemma-4.gguf``, from the
llama-cpp-python sdist: tests/real_vocab.py) is rendered by transformers
(``tokenizer.apply_chat_template(..., add_generation_prompt=True)``) and, in its runtime form
(llmexport.models.gemma4.chat_template), by the runtime (``Llm.apply_chat_template`` in a child
process that loads a dummy model: tests/mnn_dummy.py). Every conversation of the corpus (fixed
cases plus seeded random ones) is compared in both thinking modes.
"""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path
from typing import Any

import pytest

from llmexport.errors import InputError
from llmexport.mnn.config import llm_config
from llmexport.models.chat_templates import (
    ASCII_WHITESPACE,
    ChatCase,
    TemplateNotDerivable,
    runtime_context,
    runtime_messages,
    runtime_renderer,
)
from llmexport.models.gemma4.chat_template import (
    MINJA_CHAT_TEMPLATE,
    REWRITES,
    check_conversation,
    compare_chat_template,
    derive_runtime_template,
    gemma4_jinja,
    hf_render,
    is_gemma4_template,
    runtime_chat_template,
    standard_cases,
    unsupported,
)
from llmexport.options import ChatThinking
from llmexport.tiny.tokenizer import GEMMA4_CHAT_TEMPLATE, build_tiny_gemma_tokenizer

from mnn_tokenizer_server import ChatTemplateRig, MnnTokenizer, chat_template_rig
from mnn_tokenizer_server import assistant_message as _a
from mnn_tokenizer_server import user_message as _u
from real_vocab import gemma4_chat_template, parse_cases, read_gguf_metadata, real_vocab


class RuntimeRenderer:
    """``Llm.apply_chat_template`` of MNN 3.6.1 in a child process (mnn_tokenizer_server); the
    template and ``jinja.context`` are set per request with ``Llm.set_config`` (which merges)."""

    def __init__(self, child: MnnTokenizer):
        self._child = child
        self.calls = 0

    def render(self, template: str | None, messages: list[dict[str, str]], context: dict[str, Any]) -> str:
        self.calls += 1
        return self._child.render(template, messages, context)

    def renderer(self, template: str):
        return lambda messages, context: self.render(template, messages, context)


@pytest.fixture(scope="module")
def real_template() -> str:
    return gemma4_chat_template()


def CHAT_RIG(folder: Path) -> ChatTemplateRig:  # noqa: N802 (the conftest fixtures' hook)
    return chat_template_rig(folder, build_tiny_gemma_tokenizer, "<turn|>")


@pytest.fixture(scope="module")
def runtime(chat_rig) -> RuntimeRenderer:
    return RuntimeRenderer(chat_rig.runtime)


def _hf(tok, template):
    return lambda messages, thinking, tools: hf_render(tok, template, messages, thinking, tools)


# --- the corpus ---------------------------------------------------------------------------------

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "nullable": True},
        "days": {"type": "integer"},
        "filters": {"type": "object", "description": "Optional filters",
                    "properties": {"rain": {"type": "boolean"}, "wind": {"type": "number"}},
                    "required": ["rain"]},
        "hours": {"type": "array", "items": {"type": "integer", "description": "hour of day"}},
        "tags": {"type": "array", "items": {"type": ["string", "null"], "enum": ["a", "b"]}},
        "spots": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "number"}},
                                             "required": ["x"]}},
    }, "required": ["city", "days"]},
    "response": {"type": "object", "description": "The weather"},
}}
SEARCH_TOOL = {"type": "function", "function": {
    "name": "search", "description": "Web search.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
CALL = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {
    "city": "Paris", "days": 3, "unit": None, "metric": True, "hours": [9, 12.5, -3],
    "filters": {"rain": False, "wind": 0.25, "nested": {"deep": ["x", {"y": 1}]}},
    "note": 'He said "hi" <|"|> {braces} \\ backslash', "empty": "", "none_list": [None, True]}}}]}
RESPONSE = {"role": "tool", "tool_responses": [{"name": "get_weather", "response": {
    "temperature": 21, "conditions": "sunny", "hourly": [20, 21.5, 22], "alerts": [], "meta": {}}}]}

CASES = [
    ChatCase("user", [_u("Hi there!")]),
    ChatCase("system_user", [{"role": "system", "content": "You are terse."}, _u("Wie geht's? 你好 😀")]),
    ChatCase("developer", [{"role": "developer", "content": "  Follow the rules.\n"}, _u("ok")]),
    ChatCase("system_later", [_u("a"), {"role": "system", "content": " late system "}, _u("b")]),
    ChatCase("many_turns", [{"role": "system", "content": "Answer in one word."}]
             + [m for i in range(8) for m in (_u(f"Question {i}?"), _a(f"Answer {i}"))] + [_u("Last?")]),
    ChatCase("assistant_last", [_u("Say hi"), _a("hi")]),
    ChatCase("thought_in_history", [_u("2+2?"), _a("<|channel>thought\nadd them<channel|>4"), _u("and 3+3?")]),
    ChatCase("two_thoughts", [_u("q"), _a("pre <|channel>t1<channel|>mid<|channel>t2<channel|> end "), _u("q2")]),
    ChatCase("unclosed_thought", [_u("q"), _a("answer<|channel>dangling thought"), _u("q2")]),
    ChatCase("tool_call", [_u("Weather in Paris?"), CALL, RESPONSE]),
    ChatCase("tool_call_then_answer", [_u("Weather in Paris?"), CALL, RESPONSE, _a("It is sunny, 21 C."),
                                       _u("Thanks")]),
    ChatCase("tool_call_string_args", [_u("w?"), {"role": "assistant", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}]),
    ChatCase("two_tool_calls", [_u("both"), {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"function": {"name": "a", "arguments": {"x": 1}}}, {"function": {"name": "b", "arguments": {}}}]}]),
    ChatCase("tool_responses_scalar", [_u("q"), {"role": "tool", "tool_responses": [
        {"name": "a", "response": "plain text"}, {"name": "b", "response": 42}, {"name": "c", "response": [1, "x"]},
        {"name": "d", "response": None}, {"name": "e", "response": True}]}]),
    ChatCase("tool_response_unnamed", [_u("q"), {"role": "tool", "tool_responses": [{"response": {"ok": True}}]}]),
    ChatCase("tool_response_with_content", [_u("q"), {"role": "tool", "content": "extra note",
                                                      "tool_responses": [{"name": "a", "response": {"v": 1}}]}]),
    ChatCase("openai_tool_role", [_u("q"), {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": {"query": "x"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "result text"}]),
    ChatCase("image_audio_parts", [{"role": "user", "content": [
        {"type": "text", "text": " Describe "}, {"type": "image", "url": "a.png"}, {"type": "text", "text": "and"},
        {"type": "audio", "path": "b.wav"}, {"type": "video"}, {"type": "text", "text": "please.  "}]}]),
    ChatCase("parts_everywhere", [{"role": "system", "content": "sys"}, {"role": "user", "content": [
        {"type": "image"}, {"type": "image"}]}, {"role": "assistant", "content": [
            {"type": "text", "text": "<|channel>hidden<channel|>Two images."}]}, {"role": "user", "content": [
                {"type": "audio"}, {"type": "text", "text": "what is said?"}]}]),
    ChatCase("empty_contents", [_u(""), _a(""), _u("   ")]),
    ChatCase("none_values", [{"role": "system", "content": None}, {"role": "user", "content": "q", "tool_calls": None},
                             {"role": "assistant", "content": None, "tool_responses": None}]),
    ChatCase("ascii_whitespace", [{"role": "system", "content": "\t sys \r\n"}, _u("\x0b\x0clead and trail\x1c\x1d"),
                                  _a("\x1e x \x1f"), _u("\n\n\ninner\t\ttabs  and\r\nCRLF\n\n")]),
    ChatCase("inner_unicode_whitespace", [_u("a\u00a0b\u3000c\u2028d\u2029e\u0085f")]),
    ChatCase("special_strings", [_u("<|turn>user\nfake<turn|> <bos> {{ x }} {% if %} <|image|> <|\"|>"),
                                 _a("<|tool_call>call:x{}<tool_call|>")]),
    ChatCase("unicode", [_u("Grüße 🇩🇪 👩‍👩‍👧 日本語 مرحبا e\u0301"), _a("ÄÖÜ"), _u("\U0001f600")]),
    ChatCase("tools_declared", [_u("Weather?")], tools=[WEATHER_TOOL, SEARCH_TOOL]),
    ChatCase("tools_and_system", [{"role": "system", "content": "Use tools."}, _u("Weather?"), CALL, RESPONSE],
             tools=[WEATHER_TOOL]),
]

#: cases ``unsupported`` refuses, each with a part of its reason (the runtime would render them
#: differently, or transformers' rendering is not meaningful)
REFUSED_CASES = [
    (ChatCase("edge_nbsp", [_u("\u00a0hi\u3000")]), "non-ASCII whitespace"),
    (ChatCase("edge_nel_model", [_u("q"), _a("answer\u0085")]), "non-ASCII whitespace"),
    (ChatCase("float_arg", [_u("q"), {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": {"x": 0.1, "y": 1e-07}}}]}]), "float"),
    (ChatCase("big_int", [_u("q"), {"role": "tool", "tool_responses": [{"name": "f", "response": 2 ** 70}]}]),
     "64-bit"),
    (ChatCase("key_case_order", [_u("q"), {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": {"a_b": 1, "aB": 2, "Zed": 3}}}]}]), "sort differently"),
    (ChatCase("system_parts", [{"role": "system", "content": [{"type": "text", "text": "x"}]}, _u("q")]), "trims"),
    (ChatCase("role_json", [{"role": "json", "content": "{}"}]), "role 'json'"),
    (ChatCase("nul", [_u("a\x00b")]), "NUL"),
    (ChatCase("response_missing", [_u("q"), {"role": "tool", "tool_responses": [{"name": "f"}]}]), "missing"),
    (ChatCase("text_part_none", [{"role": "user", "content": [{"type": "text", "text": None}]}]), "NoneType"),
    (ChatCase("system_number", [{"role": "system", "content": 5}, _u("q")]), "int where the template trims"),
    (ChatCase("upper_unicode_type", [_u("q")], tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "straße"}}}}}]), "ASCII"),
]


def _fuzz_cases(count: int, seed: int = 2024) -> list[ChatCase]:
    """Random conversations from the pieces the template treats specially."""
    rng = random.Random(seed)
    words = ["hello", "Grüße", "模型", "😀", "<|turn>", "<turn|>", "<|channel>", "<channel|>", "thought", "x", "",
             " ", "\t", "\n", "\r\n", "\x0b", "\x0c", "\x1f", "a\u00a0b", "{{", "%}", "<|\"|>", "'", '"', "\\"]

    def text() -> str:
        out = "".join(rng.choice(words) for _ in range(rng.randint(0, 8)))
        return out + "\u3000" if rng.random() < 0.03 else out  # refused: non-ASCII whitespace at the edge

    def value(depth: int = 0) -> Any:
        kind = rng.randrange(8 if depth < 3 else 5)
        if kind == 0:
            return text()
        if kind == 1:
            return rng.randint(-10 ** 6, 10 ** 6)
        if kind == 2:
            return rng.choice([True, False, None])
        if kind == 3:
            return rng.randint(-4000, 4000) / 8 if rng.random() < 0.9 else rng.randint(1, 999) / 1000  # refused
        if kind == 4:
            return float(rng.randint(-10 ** 9, 10 ** 9))
        if kind in (5, 6):
            return {rng.choice(["a", "b", "c_d", "city", "n", "zeta", "x1", "ü", "Ab"]) + str(i): value(depth + 1)
                    for i in range(rng.randint(0, 3))}
        return [value(depth + 1) for _ in range(rng.randint(0, 3))]

    def message(role: str) -> dict[str, Any]:
        roll = rng.random()
        if role == "assistant" and roll < 0.3:
            args = value(1) if rng.random() < 0.8 else json.dumps({"q": text()})
            if not isinstance(args, (dict, str)):
                args = {"v": args}
            msg: dict[str, Any] = {"role": role, "tool_calls": [
                {"function": {"name": rng.choice(["f", "get_x"]), "arguments": args}}
                for _ in range(rng.randint(1, 2))]}
            if rng.random() < 0.5:
                msg["content"] = text()
            return msg
        if role == "tool":
            return {"role": "tool", "tool_responses": [{"name": "f", "response": value(1)}]}
        if roll < 0.25:
            parts: list[dict[str, Any]] = []
            for _ in range(rng.randint(1, 4)):
                kind = rng.choice(["text", "text", "image", "audio", "video"])
                parts.append({"type": kind, "text": text()} if kind == "text" else {"type": kind})
            return {"role": role, "content": parts}
        return {"role": role, "content": text()}

    cases = []
    for n in range(count):
        messages = []
        if rng.random() < 0.4:
            messages.append({"role": rng.choice(["system", "developer"]), "content": text()})
        for _ in range(rng.randint(1, 6)):
            role = rng.choice(["user", "assistant", "tool", "user"])
            messages.append(message(role))
        tools = [WEATHER_TOOL] if rng.random() < 0.15 else None
        cases.append(ChatCase(f"fuzz{n}", messages, tools))
    return cases


FUZZ_CASES = _fuzz_cases(300)


# --- tests --------------------------------------------------------------------------------------

def test_real_vocabulary_carries_gemma4_template(real_template):
    meta = real_vocab("gemma-4").metadata
    assert meta["general.architecture"] == "gemma4"
    assert len(real_template) == 12045 and is_gemma4_template(real_template)
    assert meta["tokenizer.ggml.tokens"][meta["tokenizer.ggml.bos_token_id"]] == "<bos>"  # what bos_token renders
    assert runtime_chat_template(real_template).kind == "gemma4"
    assert real_vocab("gemma-4").cases()[0] == ("ied 4 ½ months", [1178, 236743, 236812, 47041, 3794])


def test_gguf_reader_and_case_files(tmp_path):
    """tests/real_vocab.py's GGUF reader on a file with every value type, and the .inp/.out format."""
    import struct

    def string(text: str) -> bytes:
        raw = text.encode()
        return struct.pack("<Q", len(raw)) + raw

    values = [("u8", 0, "<B", 7), ("i8", 1, "<b", -7), ("u16", 2, "<H", 600), ("i16", 3, "<h", -600),
              ("u32", 4, "<I", 70000), ("i32", 5, "<i", -70000), ("f32", 6, "<f", 0.5), ("bool", 7, "<?", True),
              ("u64", 10, "<Q", 2 ** 40), ("i64", 11, "<q", -(2 ** 40)), ("f64", 12, "<d", 0.25)]
    body = b"".join(string(k) + struct.pack("<I", t) + struct.pack(f, v) for k, t, f, v in values)
    body += string("s") + struct.pack("<I", 8) + string("héllo")
    body += string("ints") + struct.pack("<IIQ", 9, 5, 3) + struct.pack("<3i", 1, -2, 3)
    body += string("strs") + struct.pack("<IIQ", 9, 8, 2) + string("a") + string("<bos>")
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(values) + 3) + body)
    meta = read_gguf_metadata(path)
    assert meta == {"GGUF.version": 3, **{k: v for k, _, _, v in values}, "s": "héllo", "ints": [1, -2, 3],
                    "strs": ["a", "<bos>"]}
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 1, 0, 0))
    with pytest.raises(ValueError, match="version 1"):
        read_gguf_metadata(path)
    sep = "\n__ggml_vocab_test__\n"
    assert parse_cases(f"a{sep}{sep} b\n", "1 2\n\n 3 \n") == [("a", [1, 2]), ("", []), (" b\n", [3])]


def test_old_builtin_template_differs_on_every_conversation(hf_tok, runtime, real_template):
    """The issue: the hand-written template stops at '<|turn>model\\n', HF adds the empty thought."""
    report = compare_chat_template(CASES, _hf(hf_tok, real_template), runtime.renderer(MINJA_CHAT_TEMPLATE),
                                   thinking_modes=(False,))
    assert report.count("equal") == 0 and len(report.results) == len(CASES)
    user = next(r for r in report.results if r.name == "user")
    assert user.hf is not None and user.hf.endswith("<|turn>model\n<|channel>thought\n<channel|>")
    assert user.runtime is not None and user.runtime.endswith("<|turn>model\n")


def test_real_template_unchanged_renders_tool_arguments_wrongly(hf_tok, runtime, real_template):
    """The runtime renders most of the real template as is, but not tool arguments (dictsort)."""
    report = compare_chat_template(CASES, _hf(hf_tok, real_template), runtime.renderer(real_template))
    differs = {r.name for r in report.results if r.status == "differs"}
    assert {"tool_call", "two_tool_calls", "tools_declared", "tool_response_unnamed"} <= differs
    assert {"user", "system_user", "many_turns", "image_audio_parts", "thought_in_history"}.isdisjoint(differs)
    call = next(r for r in report.results if r.name == "tool_call")
    assert call.runtime is not None and "<|tool_call>call:get_weather{city:{}," in call.runtime


@pytest.mark.parametrize("corpus", ["fixed", "fuzz"])
def test_derived_template_renders_what_transformers_renders(hf_tok, runtime, real_template, corpus):
    cases = CASES if corpus == "fixed" else FUZZ_CASES
    derived = derive_runtime_template(real_template)
    report = compare_chat_template(cases, _hf(hf_tok, real_template), runtime.renderer(derived))
    bad = [f"{r.name} thinking={r.thinking}: {r.first_difference()}" for r in report.results if r.status == "differs"]
    assert not bad, "\n".join(bad[:5])
    assert report.count("invalid") == 0
    if corpus == "fixed":
        assert report.count("equal") == 2 * len(CASES), [r.reasons for r in report.results if r.status == "refused"]
    else:
        assert report.count("equal") >= 0.6 * len(report.results), report.summary()
        # every refusal is one of the kinds the fuzzer plants on purpose, and most of them do differ
        kinds = ("non-ASCII whitespace", "float", "sort differently")
        assert all(any(k in why for k in kinds) for r in report.results for why in r.reasons)
        refused = [r for r in report.results if r.status == "refused"]
        assert len(refused) >= 20 and sum(not r.same for r in refused) >= len(refused) // 2, report.summary()
    print(f"{corpus}: {report.summary()}")


def test_standard_cases_for_a_verifier(hf_tok, runtime, real_template):
    """``standard_cases`` + ``runtime_renderer`` (set_config + apply_chat_template on a model
    object) is what a verifier runs against an export."""
    cases = standard_cases()
    assert all(not unsupported(c.messages, c.tools) for c in cases)

    class Model:  # the two calls runtime_renderer makes on an MNN.llm model
        def __init__(self):
            self.context: dict[str, Any] = {}

        def set_config(self, config):
            self.context.update(config["jinja"]["context"])

        def apply_chat_template(self, messages):
            return runtime.render(derive_runtime_template(real_template), messages, self.context)

    report = compare_chat_template(cases, _hf(hf_tok, real_template), runtime_renderer(Model()))
    assert report.ok and report.count("equal") == 2 * len(cases), report.summary()


def test_refused_conversations_name_their_reason(hf_tok, runtime, real_template):
    derived = derive_runtime_template(real_template)
    cases = [case for case, _ in REFUSED_CASES]
    report = compare_chat_template(cases, _hf(hf_tok, real_template), runtime.renderer(derived))
    for (case, reason), results in zip(REFUSED_CASES, zip(report.results[::2], report.results[1::2])):
        for result in results:
            assert result.status in ("refused", "invalid") and any(reason in why for why in result.reasons), \
                (case.name, result.reasons)
    # the refusals are needed: the runtime renders every one of them differently, in both modes
    assert all(r.status == "refused" and not r.same for r in report.results), \
        [r.name for r in report.results if r.same]
    with pytest.raises(InputError, match="non-ASCII whitespace"):
        check_conversation(REFUSED_CASES[0][0].messages)
    check_conversation(CASES[0].messages)


def _keys_sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _keys_sorted(value[k]) for k in sorted(value, key=str.lower)}
    if isinstance(value, list):
        return [_keys_sorted(v) for v in value]
    return value


def test_derived_template_means_the_same_to_jinja2(hf_tok, real_template):
    """The rewrites change nothing for transformers either (on the supported corpus), given mappings
    whose keys are already in order: Jinja2 visits a mapping's keys in insertion order where the
    runtime visits them sorted, which is what the derived loops rely on."""
    derived = derive_runtime_template(real_template)
    checked = 0
    for case in CASES + FUZZ_CASES:
        if unsupported(case.messages, case.tools):
            continue
        messages, tools = _keys_sorted(case.messages), _keys_sorted(case.tools)
        for thinking in (False, True):
            want = hf_render(hf_tok, real_template, case.messages, thinking, case.tools)
            assert hf_render(hf_tok, derived, messages, thinking, tools) == want, case.name
            checked += 1
    assert checked > len(CASES) * 2


def test_thinking_comes_from_the_exported_context(hf_tok, runtime, real_template):
    """``jinja.context.enable_thinking`` (what --chat_thinking writes) picks the mode, and a later
    ``set_config`` can switch it."""
    messages = [{"role": "system", "content": "Be brief."}, _u("Hi")]
    for thinking in (False, True):
        choice = ChatThinking.ON if thinking else ChatThinking.OFF
        jinja = llm_config({"jinja": gemma4_jinja({"chat_template": real_template})}, {},
                           choice.template_context())["jinja"]
        assert jinja["context"] == {"enable_thinking": thinking}
        # set_config merges into the loaded config: tools set by an earlier request stay unless cleared
        context = {**jinja["context"], "tools": []}
        got = runtime.render(jinja["chat_template"], runtime_messages(messages), context)
        assert got == hf_render(hf_tok, real_template, messages, thinking)
    on = runtime.render(None, runtime_messages(messages), {"enable_thinking": True})
    assert on.startswith("<bos><|turn>system\n<|think|>Be brief.<turn|>\n") and on.endswith("<|turn>model\n")
    off = runtime.render(None, runtime_messages(messages), {"enable_thinking": False})
    assert off.endswith("<|turn>model\n<|channel>thought\n<channel|>")


def test_exported_block_read_from_llm_config_file(tok_dir, hf_tok, real_template, tmp_path):
    """The jinja block as an export writes it into llm_config.json (JSON-escaped control characters
    in the strip() literal, context with thinking on) is what a freshly loaded runtime renders."""
    from mnn_dummy import run_mnn_script

    jinja = llm_config({"jinja": gemma4_jinja({"chat_template": real_template})}, {},
                       ChatThinking.ON.template_context())["jinja"]
    cases = standard_cases()
    body = """
from mnn_dummy import write_dummy_mnn_model
cfg = write_dummy_mnn_model(P["folder"], P["tokenizer"], P["vocab"], jinja=P["jinja"])
m = L.create(str(cfg))
m.load()
RESULT = [m.apply_chat_template(msgs) for msgs in P["chats"]]
"""
    model = tmp_path / "model"
    payload = {"work_dir": str(tmp_path / "child"), "folder": str(model), "vocab": len(hf_tok), "jinja": jinja,
               "tokenizer": os.path.relpath(tok_dir / "tokenizer.mtok", model),
               "chats": [runtime_messages(c.messages) for c in cases if not c.tools]}
    got = run_mnn_script(body, payload)
    want = [hf_render(hf_tok, real_template, c.messages, True) for c in cases if not c.tools]
    assert got == want and all("<|think|>" in text for text in got)


def test_tiny_checkpoint_template_passes_through(hf_tok, runtime):
    """The tiny checkpoints' own Gemma4-style template is not the real one: it is written as is,
    and the runtime renders it as transformers does."""
    chosen = runtime_chat_template(GEMMA4_CHAT_TEMPLATE)
    assert chosen.kind == "checkpoint" and chosen.template == GEMMA4_CHAT_TEMPLATE and chosen.notes == ()
    with pytest.raises(TemplateNotDerivable):
        derive_runtime_template(GEMMA4_CHAT_TEMPLATE)
    cases = [c for c in CASES if not c.tools and all(
        isinstance(m.get("content"), (str, list)) and set(m) <= {"role", "content"} for m in c.messages)]
    report = compare_chat_template(cases, _hf(hf_tok, GEMMA4_CHAT_TEMPLATE), runtime.renderer(GEMMA4_CHAT_TEMPLATE),
                                   thinking_modes=(False,))
    assert len(cases) >= 10 and all(r.same for r in report.results), report.summary()


def test_export_block_choice(real_template, caplog):
    jinja = gemma4_jinja({"chat_template": real_template, "bos": "<bos>", "eos": "<eos>"})
    assert jinja["chat_template"] == derive_runtime_template(real_template)
    assert (jinja["bos"], jinja["eos"]) == ("<bos>", "<turn|>") and "context" not in jinja
    assert gemma4_jinja(None)["chat_template"] == MINJA_CHAT_TEMPLATE
    with caplog.at_level(logging.WARNING):
        edited = gemma4_jinja({"chat_template": real_template.replace("<|think|>", "<|think|> ")})
    assert edited["chat_template"] != jinja["chat_template"] and "not the Gemma4 template" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        other = gemma4_jinja({"chat_template": "{% for m in messages %}{{ m['content'] | default('') }}{% endfor %}"})
    assert other["chat_template"].startswith("{% for m") and "default() filter" in caplog.text


def test_gemma4_llm_config_writes_the_checkpoints_template(tiny_gemma4, tmp_path, real_template):
    """``Gemma4.llm_config()``: the tiny checkpoint's own template as is, the real one derived,
    and ``enable_thinking`` from --chat_thinking (``mnn.config.llm_config``)."""
    import shutil

    from llmexport.source.checkpoint import Checkpoint
    from llmexport.source.loading import open_architecture

    tiny = tiny_gemma4("e2b", text_only=True)
    arch = open_architecture(Checkpoint.open(tiny))
    jinja = arch.llm_config()["jinja"]
    assert jinja["chat_template"] == GEMMA4_CHAT_TEMPLATE
    assert (jinja["bos"], jinja["eos"]) == ("<bos>", "<turn|>") and "context" not in jinja
    real = Path(shutil.copytree(tiny, tmp_path / "real-template"))
    (real / "chat_template.jinja").write_text(real_template, encoding="utf-8")
    arch = open_architecture(Checkpoint.open(real))
    assert arch.llm_config()["jinja"]["chat_template"] == derive_runtime_template(real_template)
    config = llm_config(arch.llm_config(), {}, ChatThinking.ON.template_context())
    assert config["jinja"]["context"] == {"enable_thinking": True}
    assert "context" not in llm_config(arch.llm_config(), {}, ChatThinking.DEFAULT.template_context())["jinja"]


def test_rewrites_are_exact(real_template):
    for rewrite in REWRITES:
        assert real_template.count(rewrite.old) == rewrite.count, rewrite.old
    derived = derive_runtime_template(real_template)
    assert "dictsort" not in derived and "default('unknown')" not in derived and "| trim -}}" in derived
    assert derive_runtime_template(real_template + "\n") == derived + "\n"
    with pytest.raises(TemplateNotDerivable, match="dictsort"):
        derive_runtime_template(real_template.replace("| dictsort", "|dictsort"))


def test_runtime_messages_and_context():
    plain = [_u("hi"), {"role": "assistant", "content": "yo"}]
    assert runtime_messages(plain) == plain
    rich = runtime_messages([{"role": "user", "content": [{"type": "image", "image": object()}]}, CALL])
    assert [m["role"] for m in rich] == ["json", "json"]
    assert json.loads(rich[0]["content"])["content"][0] == {"type": "image", "image": "<object>"}
    assert json.loads(rich[1]["content"]) == CALL
    assert runtime_context(True) == {"enable_thinking": True, "tools": []}
    assert ASCII_WHITESPACE == "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f "


def test_chat_thinking_option():
    from click.testing import CliRunner

    from llmexport.cli import export_options, main, parse_command
    from llmexport.errors import UsageError
    from llmexport.options import ExportOptions

    flags = ["--path", "x", "--dst_path", "y"]
    assert export_options(parse_command(flags)).chat_thinking is ChatThinking.DEFAULT
    on = export_options(parse_command([*flags, "--chat_thinking", "on"]))
    assert on.chat_thinking is ChatThinking.ON and on.validate() is on
    assert on.manifest_fields()["chat_thinking"] == "on"
    with pytest.raises(UsageError, match="--chat_thinking"):
        ExportOptions(chat_thinking="maybe").validate()  # type: ignore[arg-type]
    runner = CliRunner()
    assert "--chat_thinking [default|off|on]" in runner.invoke(main, ["--help"]).output
    bad = runner.invoke(main, ["--path", "x", "--dst_path", "y", "--chat_thinking", "maybe"])
    assert bad.exit_code == 2 and "--chat_thinking" in bad.output
