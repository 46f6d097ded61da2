"""LFM2's real chat templates: what MNN 3.6.1's runtime renders versus transformers.

LiquidAI's released templates (llama.cpp's ``models/templates/LFM2-8B-A1B.jinja``,
``LFM2.5-Instruct.jinja`` and ``LFM2.5-8B-A1B.jinja`` in the llama-cpp-python sdist:
tests/real_vocab.py) are rendered by transformers and, in their runtime forms
(llmexport.models.lfm2.chat_template), by the runtime (``Llm.apply_chat_template`` in a child
process: tests/mnn_tokenizer_server.py), over the tiny ``lfm2`` tokenizer style (bos
``<|startoftext|>``, LFM2's special tokens). Every conversation of the corpus (fixed cases plus
seeded random ones: system or not, tools, tool calls and results, many turns, thinking) is compared.
"""

from __future__ import annotations

import logging
import random
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from test_qwen3_5_chat_template import CALL, SEARCH_TOOL, WEATHER_TOOL

from llmexport.errors import InputError
from llmexport.models.chat_templates import ChatCase, compare_renderings
from llmexport.models.lfm2.chat_template import (
    END_OF_TURN,
    JSON_MACRO,
    LFM2,
    LFM2_5_INSTRUCT,
    LFM2_5_MOE,
    TEMPLATES,
    check_conversation,
    derive_runtime_template,
    hf_render,
    lfm2_jinja,
    runtime_chat_template,
    unsupported,
)
from llmexport.tiny.byte_level_tokenizer import LFM2_CHAT_TEMPLATE, build_byte_level_tokenizer

from mnn_tokenizer_server import ChatTemplateRig, chat_template_rig
from mnn_tokenizer_server import assistant_message as _a
from mnn_tokenizer_server import tool_message as _t
from mnn_tokenizer_server import user_message as _u
from real_vocab import sdist_template

NAMES = [t.name for t in TEMPLATES]
BY_NAME = {t.name: t for t in TEMPLATES}


def CHAT_RIG(folder: Path) -> ChatTemplateRig:  # noqa: N802 (the conftest fixtures' hook)
    return chat_template_rig(folder, lambda f: build_byte_level_tokenizer(f, "lfm2"), END_OF_TURN, (END_OF_TURN,))


def _compare(hf_tok, runtime, name: str, cases, derived: bool = True):
    source = sdist_template(name)
    written = derive_runtime_template(source, BY_NAME[name]) if derived else source
    return compare_renderings(cases, partial(unsupported, template=BY_NAME[name]),
                              lambda m, thinking, tools: hf_render(hf_tok, source, m, thinking, tools),
                              lambda m, context: runtime.render(written, m, context), (False,))


# --- the corpus ---------------------------------------------------------------------------------

PY_CALL = {"role": "assistant", "content": "Checking.", "tool_calls": [{"type": "function", "function": {
    "name": "get_weather", "arguments": {"city": "Paris", "days": 3, "metric": True, "unit": None,
                                         "hours": [9, -3, "x"],
                                         "filters": {"wind": 0.25, "rain": False, "b": {"z": 1, "a": [None]}}}}},
    {"function": {"name": "noop", "arguments": {}}}]}

CASES = [
    ChatCase("user", [_u("Hi there!")]),
    ChatCase("system_user", [{"role": "system", "content": " You are terse. "}, _u("Wie geht's? 你好 😀")]),
    ChatCase("many_turns", [{"role": "system", "content": "Answer in one word."}]
             + [m for i in range(8) for m in (_u(f"Question {i}?"), _a(f"Answer {i}"))] + [_u("Last?")]),
    ChatCase("thinking_in_history", [_u("2+2?"), _a("<think>add them</think>\n\n 4 "), _u("and 3+3?"),
                                     _a("<think>\n\n</think>6\t\n"), _u("and 4+4?")]),
    ChatCase("thinking_last_turn", [_u("2+2?"), _a("<think>add</think>\n\n4"), _a("<think>again</think> 4")]),
    ChatCase("thinking_field", [_u("q"), _a("A", thinking="why"), _u("q2"), _a("B", thinking="because")]),
    ChatCase("tool_call", [_u("Weather in Paris?"), CALL, _t("sunny"), _a("It is sunny."), _u("Thanks")],
             tools=[WEATHER_TOOL]),
    ChatCase("pythonic_calls", [{"role": "system", "content": "Use tools."}, _u("Weather?"), PY_CALL, _t("sunny"),
                                _t("21 C"), _a("Sunny, 21 C.")], tools=[WEATHER_TOOL, SEARCH_TOOL]),
    ChatCase("continue_tag", [_u("q"), _a("a CONTINUE_FINAL_MESSAGE_TAG b CONTINUE_FINAL_MESSAGE_TAG ",
                                          tool_calls=[{"function": {"name": "f", "arguments": {"x": "y"}}}])]),
    ChatCase("tools_declared", [_u("Weather?")], tools=[WEATHER_TOOL, SEARCH_TOOL]),
    ChatCase("parts", [{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": [{"text": "look", "type": "text"}, {"type": "image", "url": "a"},
                                                    {"type": "audio", "path": "b"}]}]),
    ChatCase("empty_contents", [_u(""), _a(""), _u("   ")]),
    ChatCase("ascii_whitespace", [{"role": "system", "content": "\t sys \r\n"}, _u("\x0b\x0clead\x1c"),
                                  _a("<think>x</think>\x1e x \x1f"), _u("\n\ninner\t\ttabs\r\n")]),
    ChatCase("special_strings", [_u("<|im_start|>user\nfake<|im_end|> {{ x }} {% if %} <think>"),
                                 _a("<|tool_call_start|>[f()]<|tool_call_end|>"), _u("again")]),
    ChatCase("unicode", [_u("Grüße 🇩🇪 👩‍👩‍👧 日本語 مرحبا"), _a("ÄÖÜ"), _u("\U0001f600")]),
    ChatCase("other_roles", [_u("q"), {"role": "developer", "content": "d"}, _a("x")]),
]

#: cases ``unsupported`` refuses under every template, each with a part of its reason
REFUSED_CASES = [
    (ChatCase("edge_nbsp_past_thinking", [_u("q"), _a("<think>x</think>\u00a0A\u3000"), _a("B"), _u("q2")]),
     "non-ASCII whitespace"),
    (ChatCase("float_in_tool", [_u("q")], tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "number", "minimum": 1e-07}}}]), "float"),
    (ChatCase("control_char", [_u("q")], tools=[{"type": "function", "function": {
        "name": "f", "description": "bell\x1b"}}]), "upper case"),
    (ChatCase("role_json", [{"role": "json", "content": "{}"}, _u("q")]), "role 'json'"),
    (ChatCase("nul", [_u("a\x00b")]), "NUL"),
]


def _fuzz_cases(count: int, seed: int = 2036) -> list[ChatCase]:
    rng = random.Random(seed)
    words = ["hello", "Grüße", "模型", "😀", "<think>", "</think>", "<|im_end|>", "<|tool_call_start|>", "x", "", " ",
             "\t", "\n", "\n\n", "\r\n", "\x0b", "\x1f", "a\u00a0b", "{{", "%}", "'", '"', "\\"]
    keys = ["city", "b", "a", "type", "name", "zeta", "ü", "required", "description", "enum"]

    def text() -> str:
        out = "".join(rng.choice(words) for _ in range(rng.randint(0, 8)))
        return out + "\u3000" if rng.random() < 0.03 else out

    def value(depth: int = 0) -> Any:
        makers = [text, lambda: rng.randint(-10 ** 6, 10 ** 6), lambda: rng.choice([True, False, None]),
                  lambda: rng.randint(-4000, 4000) / 8]
        if depth < 2:
            makers += [lambda: {k: value(depth + 1) for k in rng.sample(keys, rng.randint(0, 3))}]
            makers += [lambda: [value(depth + 1) for _ in range(rng.randint(0, 3))]]
        return rng.choice(makers)()

    def assistant() -> dict[str, Any]:
        body = text()
        if rng.random() < 0.4:
            body = f"<think>{text()}</think>{body}"
        msg: dict[str, Any] = _a(body)
        if rng.random() < 0.2:
            msg["thinking"] = text()
        if rng.random() < 0.3:
            msg["tool_calls"] = [{"type": "function", "function": {"name": rng.choice(["f", "get_x"]), "arguments": {
                k: value(1) for k in rng.sample(keys, rng.randint(0, 3))}}} for _ in range(rng.randint(1, 2))]
        return msg

    def tool() -> dict[str, Any]:  # few control characters (a JSON escape the runtime writes in upper case)
        def described() -> str:
            return text().replace("\x1f", "") if rng.random() < 0.9 else text()
        props = {k: {"type": rng.choice(["string", "integer"]), "description": described()}
                 for k in rng.sample(keys, 3)}
        return {"type": "function", "function": {"name": "f", "description": described(), "parameters": {
            "type": "object", "properties": props, "required": list(props)[:1]}}}

    cases = []
    for n in range(count):
        messages: list[dict[str, Any]] = []
        if rng.random() < 0.4:
            messages.append({"role": "system", "content": text()})
        messages.append(_u(text()))
        for _ in range(rng.randint(0, 6)):
            role = rng.choice(["user", "assistant", "assistant", "tool"])
            messages.append(assistant() if role == "assistant" else {"role": role, "content": text()})
        tools = [tool() for _ in range(rng.randint(1, 2))] if rng.random() < 0.4 else None
        cases.append(ChatCase(f"fuzz{n}", messages, tools))
    return cases


FUZZ_CASES = _fuzz_cases(150)


# --- tests --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_real_templates_are_the_proven_ones(name):
    source = sdist_template(name)
    chosen = runtime_chat_template(source)
    assert chosen.kind == "lfm2" and chosen.template == derive_runtime_template(source, BY_NAME[name])
    assert source.startswith("{{- bos_token -}}") and "<|im_end|>" in source and "eos_token" not in source
    assert derive_runtime_template(source + "\n", BY_NAME[name]) == chosen.template + "\n"
    if name == LFM2.name:  # the tiny LFM2 checkpoints carry the released LFM2 template
        assert LFM2_CHAT_TEMPLATE == source


@pytest.mark.parametrize("name", NAMES)
def test_real_templates_unchanged_render_differently(hf_tok, runtime, name):
    """The runtime renders plain turns of each template as is, but not tool declarations (tojson
    reorders keys); LFM2.5-8B-A1B loses every user turn (``.get()``) and its tool calls (``join``)."""
    report = _compare(hf_tok, runtime, name, CASES, derived=False)
    differs = {r.name for r in report.results if r.status == "differs"}
    assert {"tools_declared", "pythonic_calls"} <= differs
    if name == LFM2_5_MOE.name:
        assert {"user", "system_user", "many_turns"} <= differs
    else:
        assert {"user", "system_user", "many_turns", "unicode"}.isdisjoint(differs)


@pytest.mark.parametrize("corpus", ["fixed", "fuzz"])
@pytest.mark.parametrize("name", NAMES)
def test_derived_templates_render_what_transformers_renders(hf_tok, runtime, name, corpus):
    cases = CASES if corpus == "fixed" else FUZZ_CASES
    report = _compare(hf_tok, runtime, name, cases)
    bad = [f"{r.name}: {r.first_difference()}" for r in report.results if r.status == "differs"]
    assert not bad, "\n".join(bad[:5])
    assert all(r.reasons for r in report.results if r.status == "invalid")
    if corpus == "fixed":
        assert report.count("equal") == len(CASES), [(r.name, r.reasons) for r in report.results
                                                     if r.status != "equal"]
    else:
        assert report.count("equal") >= 0.65 * len(report.results), report.summary()
        refused = [r for r in report.results if r.status == "refused"]
        assert len(refused) >= 20 and all(not r.same for r in refused), report.summary()
        marker = "<|tool_call_start|>[" if name == LFM2_5_MOE.name else "List of tools: "
        assert sum(marker in (r.hf or "") for r in report.results if r.status == "equal") >= 12
    print(f"{name} {corpus}: {report.summary()}")


@pytest.mark.parametrize("name", NAMES)
def test_refused_conversations_name_their_reason(hf_tok, runtime, name):
    report = _compare(hf_tok, runtime, name, [case for case, _ in REFUSED_CASES])
    for (case, reason), result in zip(REFUSED_CASES, report.results):
        if case.name == "edge_nbsp_past_thinking" and name == LFM2.name:  # LFM2 keeps past thinking
            assert result.status == "equal"
            continue
        assert result.status in ("refused", "invalid") and any(reason in why for why in result.reasons), \
            (case.name, result.reasons)
    rendered = [r for r in report.results if r.status == "refused"]
    assert len(rendered) >= 3 and all(not r.same for r in rendered), [r.name for r in rendered if r.same]


def test_refusals_specific_to_lfm2_5_moe(hf_tok, runtime):
    """Pythonic tool calls: Python's str() of a list argument the runtime prints differently, and
    arguments that are no mapping (transformers raises)."""
    quote = [_u("q"), _a("", tool_calls=[{"function": {"name": "f", "arguments": {"x": ["it's", {"k": 1}]}}}])]
    text = [_u("q"), _a("", tool_calls=[{"function": {"name": "f", "arguments": '{"x": 1}'}}])]
    report = _compare(hf_tok, runtime, LFM2_5_MOE.name, [ChatCase("quote", quote), ChatCase("text", text)])
    assert report.results[0].status == "refused" and not report.results[0].same
    assert any("str()" in why for why in report.results[0].reasons)
    assert report.results[1].status == "invalid" and any("arguments" in why for why in report.results[1].reasons)
    with pytest.raises(InputError, match="str"):
        check_conversation(quote, template=LFM2_5_MOE)
    check_conversation(quote, template=LFM2)  # the LFM2 template prints no tool calls


def test_export_block_choice(caplog):
    source = sdist_template(LFM2.name)
    block = lfm2_jinja({"chat_template": source, "bos": "<|startoftext|>", "eos": "<|endoftext|>"})
    assert block == {"chat_template": derive_runtime_template(source, LFM2), "bos": "<|startoftext|>",
                     "eos": "<|im_end|>"}
    assert lfm2_jinja(None) is None and lfm2_jinja({"chat_template": ""}) is None
    with caplog.at_level(logging.WARNING):
        edited = lfm2_jinja({"chat_template": source.replace("List of tools", "Tools")})
    assert edited is not None and edited["chat_template"].startswith(JSON_MACRO)
    assert "not the LFM2 template" in caplog.text
    caplog.clear()
    other = "{% for m in messages %}{{ m.content | tojson }}{% endfor %}"
    with caplog.at_level(logging.WARNING):
        assert lfm2_jinja({"chat_template": other}) == {"chat_template": other, "eos": "<|im_end|>"}
    assert "tojson" in caplog.text
    # an edited LFM2.5 template gets its own rewrites (tried in TEMPLATES' order)
    moe = sdist_template(LFM2_5_MOE.name)
    derived = runtime_chat_template(moe.replace('"<image>"', '"<img>"'))
    assert derived.kind == "derived" and ".get(" not in derived.template and "| join" not in derived.template
    assert "| trim" not in derive_runtime_template(sdist_template(LFM2_5_INSTRUCT.name), LFM2_5_INSTRUCT)
