"""Qwen3.5's real chat template: what MNN 3.6.1's runtime renders versus transformers.

The real template (HF ``Qwen/Qwen3.5-4B``, vendored by llama.cpp as ``models/templates/Qwen3.5-4B.jinja``
in the llama-cpp-python sdist: tests/real_vocab.py; ``ggml-vocab-qwen35.gguf``'s own
``tokenizer.chat_template`` is a plain ChatML template, not Qwen3.5's) is rendered by transformers
and, in its runtime form (llmexport.models.qwen3_5.chat_template), by the runtime
(``Llm.apply_chat_template`` in a child process that loads a dummy model: tests/mnn_dummy.py,
tests/mnn_tokenizer_server.py). Every conversation of the corpus (fixed cases plus seeded random
ones) is compared with thinking off and on.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import Any

import pytest

from llmexport.errors import InputError
from llmexport.mnn.config import llm_config
from llmexport.models.chat_templates import ChatCase, TemplateNotDerivable, runtime_messages
from llmexport.models.qwen3_5.chat_template import (
    END_OF_TURN,
    JSON_MACRO,
    REWRITES,
    check_conversation,
    compare_chat_template,
    derive_runtime_template,
    hf_render,
    is_qwen3_5_template,
    qwen3_5_jinja,
    runtime_chat_template,
    unsupported,
)
from llmexport.options import ChatThinking
from llmexport.tiny.byte_level_tokenizer import build_byte_level_tokenizer

from mnn_tokenizer_server import ChatTemplateRig, chat_template_rig
from mnn_tokenizer_server import assistant_message as _a
from mnn_tokenizer_server import tool_message as _t
from mnn_tokenizer_server import user_message as _u
from real_vocab import qwen3_5_chat_template, real_vocab


@pytest.fixture(scope="module")
def real_template() -> str:
    return qwen3_5_chat_template()


def CHAT_RIG(folder: Path) -> ChatTemplateRig:  # noqa: N802 (the conftest fixtures' hook)
    return chat_template_rig(folder, lambda f: build_byte_level_tokenizer(f, "qwen"), END_OF_TURN, (END_OF_TURN,))


def _hf(tok, template):
    return lambda messages, thinking, tools: hf_render(tok, template, messages, thinking, tools)


def _rt(runtime, template):
    return lambda messages, context: runtime.render(template, messages, context)


# --- the corpus ---------------------------------------------------------------------------------

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "default": 3},
        "name": {"type": "string"},  # a property the runtime's tojson would move to the front
        "filters": {"description": "Optional filters", "type": "object",
                    "properties": {"wind": {"type": "number"}, "rain": {"type": "boolean"}}, "required": ["rain"]},
        "hours": {"type": "array", "items": {"type": "integer"}},
    }, "required": ["city", "days"]}}}
SEARCH_TOOL = {"type": "function", "function": {
    "name": "search", "description": "Web search: \"quoted\", back\\slash, 中文.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
CALL = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "call_1", "function": {
    "name": "get_weather", "arguments": {
        "city": "Paris", "days": 3, "unit": None, "metric": True, "hours": [9, 12.5, -3],
        "filters": {"wind": 0.25, "rain": False, "nested": {"z": ["x", {"y": 1}], "a": None}},
        "note": 'He said "hi" {braces} \\ backslash\nline two', "empty": "", "list": []}}}]}

CASES = [
    ChatCase("user", [_u("Hi there!")]),
    ChatCase("system_user", [{"role": "system", "content": " You are terse. "}, _u("Wie geht's? 你好 😀")]),
    ChatCase("system_parts", [{"role": "system", "content": [{"type": "text", "text": "Be "},
                                                             {"type": "text", "text": "brief."}]}, _u("q")]),
    ChatCase("many_turns", [{"role": "system", "content": "Answer in one word."}]
             + [m for i in range(8) for m in (_u(f"Question {i}?"), _a(f"Answer {i}"))] + [_u("Last?")]),
    ChatCase("thinking_in_history", [_u("2+2?"), _a("<think>\nadd them\n</think>\n\n4"), _u("and 3+3?"),
                                     _a("<think>\n\n</think>\n\n6"), _u("and 4+4?")]),
    ChatCase("thinking_last_turn", [_u("2+2?"), _a("<think>\nadd them\n</think>\n\n4")]),
    ChatCase("think_without_open", [_u("q"), _a("reasoning only</think>answer"), _u("q2")]),
    ChatCase("reasoning_content", [_u("q"), {"role": "assistant", "content": "A.", "reasoning_content": "\n why \n"}]),
    ChatCase("reasoning_content_history", [_u("q"), {"role": "assistant", "content": "A.",
                                                     "reasoning_content": "dropped"}, _u("q2")]),
    ChatCase("assistant_last", [_u("Say hi"), _a("hi")]),
    ChatCase("tool_call", [_u("Weather in Paris?"), CALL, _t("sunny")]),
    ChatCase("tool_call_thinking", [_u("Weather?"),
                                    {**CALL, "content": "<think>\nneed a tool\n</think>\n\nLet me check."},
                                    _t("sunny"), _t("21 C"), {"role": "assistant", "content": "Sunny, 21 C."}]),
    ChatCase("tool_call_then_answer", [_u("Weather in Paris?"), CALL, _t("sunny"), _a("It is sunny."), _u("Thanks")]),
    ChatCase("two_tool_calls", [_u("both"), {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"function": {"name": "a", "arguments": {"x": 1}}}, {"name": "b", "arguments": {}},
        {"function": {"name": "c"}}]}, _t("A"), _t("B"), _t("C"), _u("ok")]),
    ChatCase("tool_first_role", [_u("q"), _t("orphan response")]),
    ChatCase("tool_response_as_user", [_u("q"), CALL, _u("<tool_response>\nsunny\n</tool_response>")]),
    ChatCase("image_video_parts", [{"role": "user", "content": [
        {"type": "text", "text": " Describe "}, {"type": "image", "url": "a.png"}, {"type": "text", "text": "and"},
        {"type": "video", "path": "b.mp4"}, {"image_url": "c.png"}, {"type": "text", "text": "please.  "}]}]),
    ChatCase("empty_contents", [_u(""), _a(""), _u("   ")]),
    ChatCase("none_values", [{"role": "system", "content": None}, {"role": "user", "content": "q", "tool_calls": None},
                             {"role": "assistant", "content": None, "reasoning_content": None}, _u("q2")]),
    ChatCase("ascii_whitespace", [{"role": "system", "content": "\t sys \r\n"}, _u("\x0b\x0clead and trail\x1c\x1d"),
                                  _a("\x1e x \x1f"), _u("\n\n\ninner\t\ttabs  and\r\nCRLF\n\n")]),
    ChatCase("inner_unicode_whitespace", [_u("a\u00a0b\u3000c\u2028d\u2029e\u0085f")]),
    ChatCase("special_strings", [_u("<|im_start|>user\nfake<|im_end|> {{ x }} {% if %} <tool_call> <think>"),
                                 _a("<tool_call>\n<function=x>\n</function>\n</tool_call>"), _u("again")]),
    ChatCase("unicode", [_u("Grüße 🇩🇪 👩‍👩‍👧 日本語 مرحبا e\u0301"), _a("ÄÖÜ"), _u("\U0001f600")]),
    ChatCase("tools_declared", [_u("Weather?")], tools=[WEATHER_TOOL, SEARCH_TOOL]),
    ChatCase("tools_and_system", [{"role": "system", "content": "Use tools."}, _u("Weather?"), CALL, _t("sunny")],
             tools=[WEATHER_TOOL]),
    ChatCase("tools_empty_system", [{"role": "system", "content": "  "}, _u("Weather?")], tools=[SEARCH_TOOL]),
]

#: cases ``unsupported`` refuses, each with a part of its reason
REFUSED_CASES = [
    (ChatCase("edge_nbsp", [_u("\u00a0hi\u3000")]), "non-ASCII whitespace"),
    (ChatCase("reasoning_edge", [_u("q"), _a("<think>\nwhy\u3000\n</think>\n\nA")]), "non-ASCII whitespace"),
    (ChatCase("float_arg", [_u("q"), {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": {"x": 0.1, "y": 1e-07}}}]}]), "float"),
    (ChatCase("float_in_tool", [_u("q")], tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "number", "minimum": 1e-07}}}]), "float"),
    (ChatCase("big_int", [_u("q"), {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": {"x": [2 ** 70]}}}]}]), "64-bit"),
    (ChatCase("control_char", [_u("q")], tools=[{"type": "function", "function": {
        "name": "f", "description": "bell\x1b"}}]), "upper case"),
    (ChatCase("role_json", [{"role": "json", "content": "{}"}, _u("q")]), "role 'json'"),
    (ChatCase("nul", [_u("a\x00b")]), "NUL"),
    (ChatCase("text_part_none", [{"role": "user", "content": [{"type": "text", "text": None}]}]), "NoneType"),
    (ChatCase("string_arguments", [_u("w?"), {"role": "assistant", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}]), "raises"),
    (ChatCase("system_later", [_u("a"), {"role": "system", "content": "late"}, _u("b")]), "raises"),
    (ChatCase("no_query", [{"role": "system", "content": "s"}, _a("x")]), "no user query"),
    (ChatCase("image_in_system", [{"role": "system", "content": [{"type": "image"}]}, _u("q")]), "raises"),
    (ChatCase("developer_role", [{"role": "developer", "content": "d"}, _u("q")]), "raises"),
    (ChatCase("number_content", [_u(5)]), "raises"),
]


def _fuzz_cases(count: int, seed: int = 2035) -> list[ChatCase]:
    """Random conversations from the pieces the template treats specially."""
    rng = random.Random(seed)
    words = ["hello", "Grüße", "模型", "😀", "<think>", "</think>", "<tool_response>", "</tool_response>", "<|im_end|>",
             "x", "", " ", "\t", "\n", "\n\n", "\r\n", "\x0b", "\x0c", "\x1f", "a\u00a0b", "{{", "%}", "'", '"', "\\"]
    keys = ["city", "b", "a", "type", "name", "zeta", "x1", "ü", "Ab", "required", "description", "enum", "items"]

    def text() -> str:
        out = "".join(rng.choice(words) for _ in range(rng.randint(0, 8)))
        return out + "\u3000" if rng.random() < 0.03 else out  # refused: non-ASCII whitespace at the edge

    def value(depth: int = 0) -> Any:
        if rng.random() < 0.02:
            return rng.randint(1, 999) / 1000  # refused: the runtime may change its digits
        makers = [text, lambda: rng.randint(-10 ** 6, 10 ** 6), lambda: rng.choice([True, False, None]),
                  lambda: rng.randint(-4000, 4000) / 8, lambda: float(rng.randint(-10 ** 9, 10 ** 9))]
        if depth < 3:  # mappings with keys in random order (unsorted, priority names included), lists
            makers += [lambda: {k: value(depth + 1) for k in rng.sample(keys, rng.randint(0, 4))}] * 2
            makers += [lambda: [value(depth + 1) for _ in range(rng.randint(0, 3))]]
        return rng.choice(makers)()

    def content() -> Any:
        if rng.random() < 0.2:
            parts: list[dict[str, Any]] = []
            for _ in range(rng.randint(1, 4)):
                kind = rng.choice(["text", "text", "image", "video"])
                parts.append({"type": "text", "text": text()} if kind == "text" else {"type": kind})
            return parts
        return text()

    def assistant() -> dict[str, Any]:
        roll = rng.random()
        body = text()
        if roll < 0.4:
            body = f"<think>\n{text()}\n</think>\n\n{body}"
        msg: dict[str, Any] = {"role": "assistant", "content": body}
        if rng.random() < 0.15:
            msg["reasoning_content"] = text()
        if rng.random() < 0.3:
            msg["tool_calls"] = [{"type": "function", "function": {"name": rng.choice(["f", "get_x"]), "arguments": {
                k: value(1) for k in rng.sample(keys, rng.randint(0, 4))}}} for _ in range(rng.randint(1, 2))]
        return msg

    def tool() -> dict[str, Any]:
        props = {k: {"type": rng.choice(["string", "integer"]), **({"description": text()} if rng.random() < 0.5
                                                                    else {})} for k in rng.sample(keys, 3)}
        return {"type": "function", "function": {"name": "f", "description": text(), "parameters": {
            "type": "object", "properties": props, "required": list(props)[:1]}}}

    cases = []
    for n in range(count):
        messages: list[dict[str, Any]] = []
        if rng.random() < 0.4:
            messages.append({"role": "system", "content": text() if rng.random() < 0.8 else
                             [{"type": "text", "text": text()}]})
        messages.append({"role": "user", "content": content()})
        for _ in range(rng.randint(0, 6)):
            role = rng.choice(["user", "assistant", "assistant", "tool"])
            messages.append(assistant() if role == "assistant" else {"role": role, "content": content()})
        tools = [tool() for _ in range(rng.randint(1, 2))] if rng.random() < 0.2 else None
        cases.append(ChatCase(f"fuzz{n}", messages, tools))
    return cases


FUZZ_CASES = _fuzz_cases(300)


# --- tests --------------------------------------------------------------------------------------

def test_real_template_source(real_template):
    """The template the rewrites were proven on, and what the vocabulary file carries instead."""
    assert len(real_template) == 7756 and is_qwen3_5_template(real_template)
    assert runtime_chat_template(real_template).kind == "qwen3_5"
    meta = real_vocab("qwen35").metadata
    # the GGUF's own template is plain ChatML ("You are a helpful assistant"), no thinking, no tools
    assert "enable_thinking" not in meta["tokenizer.chat_template"]
    assert meta["tokenizer.ggml.tokens"][151645] == END_OF_TURN and meta["tokenizer.ggml.token_type"][151645] == 3
    # the template never uses bos_token / eos_token: only <|im_end|> ends a turn
    assert "bos_token" not in real_template and "eos_token" not in real_template
    assert real_template.count("<|im_end|>") == 6


def test_real_template_unchanged_renders_tools_wrongly(hf_tok, runtime, real_template):
    """The runtime renders plain conversations of the real template as is, but not tool
    declarations and arguments (tojson reorders keys), tool responses (loop.previtem), nor trims
    of VT/FF/FS..US."""
    report = compare_chat_template(CASES, _hf(hf_tok, real_template), _rt(runtime, real_template))
    differs = {r.name for r in report.results if r.status == "differs"}
    assert {"tool_call", "tools_declared", "two_tool_calls", "ascii_whitespace"} <= differs
    assert {"user", "system_user", "many_turns", "thinking_in_history", "reasoning_content",
            "image_video_parts"}.isdisjoint(differs)
    two = next(r for r in report.results if r.name == "two_tool_calls")
    assert two.hf is not None and "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nA" in two.hf
    assert two.runtime is not None and "</tool_call><|im_end|>\n\n<tool_response>\nA" in two.runtime
    declared = next(r for r in report.results if r.name == "tools_declared")
    assert declared.runtime is not None and '"properties": {"name": {"type": "string"}, "city"' in declared.runtime


@pytest.mark.parametrize("corpus", ["fixed", "fuzz"])
def test_derived_template_renders_what_transformers_renders(hf_tok, runtime, real_template, corpus):
    cases = CASES if corpus == "fixed" else FUZZ_CASES
    derived = derive_runtime_template(real_template)
    report = compare_chat_template(cases, _hf(hf_tok, real_template), _rt(runtime, derived))
    bad = [f"{r.name} thinking={r.thinking}: {r.first_difference()}" for r in report.results if r.status == "differs"]
    assert not bad, "\n".join(bad[:5])
    # whatever transformers rejects, unsupported() names a reason for
    assert all(r.reasons[1:] for r in report.results if r.status == "invalid")
    if corpus == "fixed":
        assert report.count("equal") == 2 * len(CASES), [r.reasons for r in report.results if r.status != "equal"]
    else:
        assert report.count("equal") >= 0.6 * len(report.results), report.summary()
        kinds = ("non-ASCII whitespace", "float", "upper case", "raises", "no user query")
        assert all(any(k in why for k in kinds) for r in report.results for why in r.reasons), report.summary()
        refused = [r for r in report.results if r.status == "refused"]
        assert len(refused) >= 20 and sum(not r.same for r in refused) >= len(refused) // 3, report.summary()
        tools = [r for r in report.results if r.status == "equal" and "<tools>" in (r.hf or "")]
        calls = [r for r in report.results if r.status == "equal" and "<parameter=" in (r.hf or "")]
        assert len(tools) >= 20 and len(calls) >= 40, (len(tools), len(calls))
    print(f"{corpus}: {report.summary()}")


def test_refused_conversations_name_their_reason(hf_tok, runtime, real_template):
    derived = derive_runtime_template(real_template)
    cases = [case for case, _ in REFUSED_CASES]
    report = compare_chat_template(cases, _hf(hf_tok, real_template), _rt(runtime, derived))
    for (case, reason), results in zip(REFUSED_CASES, zip(report.results[::2], report.results[1::2])):
        for result in results:
            assert result.status in ("refused", "invalid") and any(reason in why for why in result.reasons), \
                (case.name, result.reasons)
    # where transformers renders, the runtime renders differently: the refusals are needed
    rendered = [r for r in report.results if r.status == "refused"]
    assert len(rendered) >= 14 and all(not r.same for r in rendered), [r.name for r in rendered if r.same]
    with pytest.raises(InputError, match="non-ASCII whitespace"):
        check_conversation(REFUSED_CASES[0][0].messages)
    check_conversation(CASES[0].messages, [WEATHER_TOOL])


def test_derived_template_means_the_same_to_jinja2(hf_tok, real_template):
    """The rewrites change nothing for transformers either (on the supported corpus): qwen_json
    prints what tojson prints, strip() with the ASCII set is trim where no other whitespace is."""
    derived = derive_runtime_template(real_template)
    checked = 0
    for case in CASES + FUZZ_CASES:
        if unsupported(case.messages, case.tools):
            continue
        for thinking in (False, True):
            try:
                want = hf_render(hf_tok, real_template, case.messages, thinking, case.tools)
            except Exception:
                continue
            assert hf_render(hf_tok, derived, case.messages, thinking, case.tools) == want, case.name
            checked += 1
    assert checked > 350


def test_thinking_comes_from_the_exported_context(hf_tok, runtime, real_template):
    """``jinja.context.enable_thinking`` (what --chat_thinking writes) picks the mode; without it
    (--chat_thinking default) the template's own default, thinking on, as transformers does."""
    messages = [{"role": "system", "content": "Be brief."}, _u("Hi")]
    block = qwen3_5_jinja({"chat_template": real_template})
    assert block is not None
    for choice, ending in ((ChatThinking.OFF, "<think>\n\n</think>\n\n"), (ChatThinking.ON, "<think>\n"),
                           (ChatThinking.DEFAULT, "<think>\n")):
        jinja = llm_config({"jinja": block}, {}, choice.template_context())["jinja"]
        # None (not false) where the block has no context: the template's default, thinking on
        context = {"enable_thinking": None, **jinja.get("context", {}), "tools": []}
        got = runtime.render(jinja["chat_template"], runtime_messages(messages), context)
        thinking = choice is not ChatThinking.OFF
        assert got == hf_render(hf_tok, real_template, messages, thinking)
        assert got.endswith("<|im_start|>assistant\n" + ending), (choice, got)
    plain = hf_tok.apply_chat_template(messages, chat_template=real_template, tokenize=False,
                                       add_generation_prompt=True)
    assert plain.endswith("<|im_start|>assistant\n<think>\n")  # transformers' default is on


def test_vision_ids_from_context(hf_tok, runtime, real_template):
    """``add_vision_id`` (a template variable transformers' processors pass) set through
    ``jinja.context``: pictures and videos are counted across turns in both engines."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a"}, {"type": "video"},
                                             {"type": "image"}]}, _a("x"), {"role": "user", "content": [
                                                 {"type": "image"}]}]
    want = hf_tok.apply_chat_template(messages, chat_template=real_template, tokenize=False,
                                      add_generation_prompt=True, add_vision_id=True)
    got = runtime.render(derive_runtime_template(real_template), runtime_messages(messages),
                         {"add_vision_id": True, "enable_thinking": None, "tools": []})
    assert got == want and "Picture 3: <|vision_start|>" in got and "Video 1: " in got
    assert "Picture" not in runtime.render(None, runtime_messages(messages), {"add_vision_id": False})


def test_exported_block_read_from_llm_config_file(tok_dir, hf_tok, real_template, tmp_path):
    """The jinja block as an export writes it into llm_config.json (JSON-escaped control characters
    in the strip() literal, context with thinking off, tools in the context) is what a freshly
    loaded runtime renders; the rendering encodes with <|im_end|> as one id, a stop id."""
    from mnn_dummy import run_mnn_script

    jinja = llm_config({"jinja": qwen3_5_jinja({"chat_template": real_template})}, {},
                       ChatThinking.OFF.template_context())["jinja"]
    jinja["context"]["tools"] = [WEATHER_TOOL]
    cases = [c for c in CASES if c.name in ("system_user", "thinking_in_history", "tool_call_then_answer",
                                            "ascii_whitespace")]
    body = """
from mnn_dummy import write_dummy_mnn_model
cfg = write_dummy_mnn_model(P["folder"], P["tokenizer"], P["vocab"], jinja=P["jinja"])
m = L.create(str(cfg))
m.load()
texts = [m.apply_chat_template(msgs) for msgs in P["chats"]]
RESULT = {"texts": texts, "ids": m.tokenizer_encode(texts[0]), "eot": m.tokenizer_encode(P["eot"])}
"""
    model = tmp_path / "model"
    payload = {"work_dir": str(tmp_path / "child"), "folder": str(model), "vocab": len(hf_tok), "jinja": jinja,
               "tokenizer": os.path.relpath(tok_dir / "tokenizer.mtok", model), "eot": END_OF_TURN,
               "chats": [runtime_messages(c.messages) for c in cases]}
    got = run_mnn_script(body, payload)
    want = [hf_render(hf_tok, real_template, c.messages, False, [WEATHER_TOOL]) for c in cases]
    assert got["texts"] == want
    eot = hf_tok.convert_tokens_to_ids(END_OF_TURN)
    assert got["eot"] == [eot] and got["ids"] == hf_tok(want[0], add_special_tokens=False)["input_ids"]
    stop_line = (tok_dir / "tokenizer.mtok").read_bytes().split(b"\n")[2].split()
    assert str(eot).encode() in stop_line


def test_export_block_choice(real_template, caplog):
    block = qwen3_5_jinja({"chat_template": real_template})
    assert block == {"chat_template": derive_runtime_template(real_template), "eos": "<|im_end|>"}
    assert qwen3_5_jinja(None) is None and qwen3_5_jinja({"chat_template": ""}) is None
    kept = qwen3_5_jinja({"chat_template": real_template, "bos": "<s>", "eos": "<|endoftext|>"})
    assert kept is not None and (kept["bos"], kept["eos"]) == ("<s>", "<|im_end|>")
    with caplog.at_level(logging.WARNING):
        edited = qwen3_5_jinja({"chat_template": real_template.replace("# Tools", "# Tools ")})
    assert edited is not None and edited["chat_template"].startswith(JSON_MACRO)
    assert "not the Qwen3.5 template" in caplog.text
    caplog.clear()
    other = "{% for m in messages %}{{ m | tojson }}{% if loop.nextitem %},{% endif %}{% endfor %}"
    with caplog.at_level(logging.WARNING):
        passed = qwen3_5_jinja({"chat_template": other})
    assert passed == {"chat_template": other, "eos": "<|im_end|>"}
    assert "tojson" in caplog.text and "loop.previtem/nextitem" in caplog.text


def test_rewrites_are_exact(real_template):
    for rewrite in REWRITES:
        assert real_template.count(rewrite.old) >= rewrite.count, rewrite.old
    derived = derive_runtime_template(real_template)
    assert "| tojson | safe" not in derived and "previtem" not in derived and "nextitem" not in derived
    assert "|trim" not in derived and derived.startswith(JSON_MACRO)
    assert derive_runtime_template(real_template + "\n") == derived + "\n"
    with pytest.raises(TemplateNotDerivable, match="previtem"):
        derive_runtime_template(real_template.replace("loop.previtem and", "loop.previtem  and"))


def test_unsupported_details():
    ok = [_u("q"), {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {
        "a": 0.5, "b": 1e14, "c": -(2 ** 63), "d": "\x0c\x09\x1f"}}}]}]  # \x1f printed raw by | string
    assert unsupported(ok) == []
    assert any("upper case" in r for r in unsupported(ok, [{"x": "\x1f"}]))
    assert unsupported([_u("q")], [{"x": "\x10\x19\x0c"}]) == []  # escapes without hex letters agree
    assert any("non-string" in r for r in unsupported([_u("q")], [{1: "x"}]))
    assert any("empty" in r for r in unsupported([]))
