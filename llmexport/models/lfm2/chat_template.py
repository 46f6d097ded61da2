"""LFM2's chat templates for MNN's runtime, and what of them the runtime cannot render as transformers does.

MNN 3.6.1 renders ``llm_config.json``'s ``jinja.chat_template`` with its own Jinja engine; what a
template sees there and how that engine differs from Jinja2: llmexport.models.chat_templates and
docs/chat-templates.md. LiquidAI's released templates (``TEMPLATES``, as vendored by llama.cpp in
``models/templates/``) share one layout: ``bos_token``, an optional system message, tools as a JSON
list in the system turn ("List of tools: [...]"), ChatML turns ending with ``<|im_end|>`` (the
runtime's stop token). Each is exported in a runtime form (its ``rewrites``, proven equal to
transformers' rendering by tests/test_lfm2_chat_template.py):

* ``LFM2-8B-A1B`` (the LFM2 family's template; tool results between ``<|tool_response_start|>`` and
  ``<|tool_response_end|>``): only ``tojson`` differs (the runtime reorders mapping keys) -> the
  shared ``json_macro``;
* ``LFM2.5-Instruct`` (past thinking dropped before the last assistant turn unless
  ``keep_past_thinking``): ``tojson``, and ``| trim`` (the runtime strips only space/tab/CR/LF) ->
  ``.strip()`` with the ASCII whitespace Python strips;
* ``LFM2.5-8B-A1B`` (macros, pythonic tool calls, ``message.thinking``, ``preserve_thinking``): besides
  those two, ``.get(...)`` and ``.items()`` are unknown methods (``""`` in the runtime) -> item access
  and ``| items``; ``| join`` is unknown (passed through) -> strings built in the loop; strings cannot
  be sliced (``content[:n]``, transformers' continue-final-message tag) -> a loop over
  ``split``. HF's ``{% generation %}``/``{% endgeneration %}`` (assistant masks in transformers) are
  unknown blocks the runtime skips, keeping their body: they render as in Jinja2, unchanged.

``keep_past_thinking | default(false)`` / ``preserve_thinking | default(false)``: the runtime passes
the value through, which is falsy when undefined, as ``false`` is: left alone. What stays different
is refused by ``unsupported`` with a reason (the engine's number and whitespace limits, Python's
``str()`` of lists in tool-call arguments where the runtime's differs, and what transformers itself
rejects: the runtime renders those silently).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmexport.models.chat_templates import (
    WS_LITERAL,
    ConversationChecker,
    Messages,
    Rewrite,
    RuntimeChatTemplate,
    TemplateNotDerivable,
    apply_rewrites,
    choose_runtime_template,
    jinja_block,
    json_macro,
    json_template_warnings,
    raise_unsupported,
    template_sha256,
    transformers_render,
    trim_rewrite,
)

#: the token that ends every turn (the runtime's stop token; ``jinja.eos``)
END_OF_TURN = "<|im_end|>"
JSON = "lfm2_json"
JSON_MACRO = json_macro(JSON)
_TOJSON = "the runtime's tojson reorders keys (priority list, then bytes); lfm2_json keeps insertion order"


def _tojson(expr: str, count: int = 1) -> Rewrite:
    return Rewrite(_TOJSON, f"{expr} | tojson", f"{JSON}({expr})", count)


_THINK_TRIM = trim_rewrite('content.split("</think>")[-1] | trim', f'content.split("</think>")[-1].strip({WS_LITERAL})')


@dataclass(frozen=True)
class Lfm2Template:
    """One released template: its name (llama.cpp's file name), SHA-256 and runtime rewrites."""

    name: str
    sha256: str
    rewrites: tuple[Rewrite, ...]


LFM2 = Lfm2Template("LFM2-8B-A1B", "2294f49b51a0b9a1b0194add3f124237b5bd986599f43180eec49bba4de01365", (
    _tojson("tool"), _tojson("content")))
LFM2_5_INSTRUCT = Lfm2Template(
    "LFM2.5-Instruct", "f05bf4b967dc993bdc7a2fe6e43759ee218eb0eb340d68b063e1c4f8ad148176",
    (_tojson("tool"), _tojson("content"), _THINK_TRIM))
LFM2_5_MOE = Lfm2Template(
    "LFM2.5-8B-A1B", "6d65c8804847ad74eea912dd7eca3dc1cf7a457b53a77f47d841a14121910963", (
    _tojson("arg_value"), _tojson("item"), _tojson("tool"),
    Rewrite("dict.get() is unknown to the runtime (yields '')", 'messages[0].get("content")',
            'messages[0]["content"]'),
    Rewrite("dict.get() is unknown to the runtime (yields '')", 'message.get("content")', 'message["content"]'),
    Rewrite("dict.items() is unknown to the runtime (yields '')", "func_args.items()", "func_args | items"),
    Rewrite("join is unknown to the runtime: the argument string is built in the loop",
            "namespace(arg_strings=[])", 'namespace(arg_strings="")'),
    Rewrite("join is unknown to the runtime: the argument string is built in the loop",
            'args_ns.arg_strings + [arg_name + "=" + format_arg_value(arg_value)]',
            'args_ns.arg_strings + ("" if loop.first else ", ") + arg_name + "=" + format_arg_value(arg_value)'),
    Rewrite("join is unknown to the runtime", '(args_ns.arg_strings | join(", "))', "args_ns.arg_strings"),
    Rewrite("join is unknown to the runtime: the call list is built in the loop",
            "namespace(tool_calls=[])", 'namespace(tool_calls="")'),
    Rewrite("join is unknown to the runtime: the call list is built in the loop",
            'tool_calls_ns.tool_calls + [func_name + "(" + args_ns.arg_strings + ")"]',
            'tool_calls_ns.tool_calls + ("" if loop.first else ", ") + func_name + "(" + args_ns.arg_strings + ")"'),
    Rewrite("join is unknown to the runtime", '(tool_calls_ns.tool_calls | join(", "))', "tool_calls_ns.tool_calls"),
    _THINK_TRIM,
    Rewrite("the runtime cannot slice strings: the text before the last tag, by split",
            "{{- content[:_trunc_len] -}}",
            "{%- for _part in content.split(_cfm_tag)[:-1] -%}{{- _cfm_tag if not loop.first else '' -}}"
            "{{- _part -}}{%- endfor -%}"),
))
#: the released templates, those with the most rewrites first (tried in this order on an unknown one)
TEMPLATES = (LFM2_5_MOE, LFM2_5_INSTRUCT, LFM2)


def known_template(template: str) -> Lfm2Template | None:
    """The released template ``template`` is (trailing whitespace aside), if any."""
    return next((t for t in TEMPLATES if t.sha256 and template_sha256(template) == t.sha256), None)


def derive_runtime_template(source: str, template: Lfm2Template) -> str:
    """``JSON_MACRO`` + ``source`` with ``template``'s rewrites applied; raises TemplateNotDerivable
    when one of them does not occur exactly as often as expected."""
    return JSON_MACRO + apply_rewrites(source, template.rewrites)


def runtime_chat_template(checkpoint_template: str | None) -> RuntimeChatTemplate:
    """What to write for an LFM2 checkpoint's template: ``kind`` ``"lfm2"`` (a released template,
    derived), ``"derived"`` (a released template's rewrites apply, the text differs: not proven),
    ``"checkpoint"`` (passed through with the lint's notes) or ``"none"``."""
    if not checkpoint_template:
        return RuntimeChatTemplate("", "none", ("the checkpoint has no chat template",))
    known = known_template(checkpoint_template)
    candidates = (known,) if known else TEMPLATES

    def derive(source: str) -> str:
        for candidate in candidates:
            try:
                return derive_runtime_template(source, candidate)
            except TemplateNotDerivable:
                continue
        raise TemplateNotDerivable("no LFM2 template's rewrites apply")

    return choose_runtime_template(checkpoint_template, derive, known.sha256 if known else "", "lfm2", "LFM2",
                                   json_template_warnings)


def lfm2_jinja(checkpoint: dict[str, str] | None) -> dict[str, Any] | None:
    """``llm_config.json``'s ``jinja`` block for an LFM2 checkpoint (``checkpoint``:
    ``DecoderFamily.checkpoint_chat_template()``, whose ``bos`` is kept): the runtime form of its
    template and ``eos`` = ``<|im_end|>``; None without a template."""
    return jinja_block(checkpoint, runtime_chat_template((checkpoint or {}).get("chat_template")), END_OF_TURN)


# --- conversations --------------------------------------------------------------------------

def _runtime_repr(value: Any) -> str | None:
    """How the runtime's ``| string`` prints ``value`` inside a list (``to_python_repr`` of MNN
    3.6.1's jinja.hpp: ``'...'`` escaping only quote, backslash, LF and CR); None for a mapping
    (printed with reordered keys)."""
    if isinstance(value, str):
        body = value.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n").replace("\r", "\\r")
        return f"'{body}'"
    if isinstance(value, (list, tuple)):
        parts = [_runtime_repr(item) for item in value]
        return None if None in parts else "[" + ", ".join(p for p in parts if p is not None) + "]"
    if isinstance(value, dict):
        return None
    return str(value)


class _Checker(ConversationChecker):
    def __init__(self, template: Lfm2Template) -> None:
        super().__init__()
        self.template = template

    def content(self, where: str, content: Any) -> str | None:
        """The text the template makes of ``content`` (None where transformers raises)."""
        if isinstance(content, str):
            return content
        if self.template is not LFM2_5_MOE:  # printed as JSON
            self.json_value(where, content)
            return json.dumps(content, ensure_ascii=False)
        parts = self.parts(where, content)
        if parts is None:
            return None
        out = []
        for at, part in parts:
            if part.get("type") == "image":
                out.append("<image>")
            elif part.get("type") == "text":
                if not isinstance(part.get("text"), str):
                    self.fail(f"{at}.text", "a text part without string text (transformers raises)")
                    return None
                out.append(part["text"])
            else:
                self.json_value(at, part)
                out.append(json.dumps(part, ensure_ascii=False))
        return "".join(out)

    def past_thinking(self, where: str, content: str) -> None:
        """An assistant turn whose thinking the template drops: what follows ``</think>`` is trimmed."""
        if "</think>" in content:
            self.trimmed(where, content.split("</think>")[-1])

    def tool_call(self, where: str, call: Any) -> None:
        function = self.called_function(where, call)  # transformers raises without one
        if function is None:
            return
        arguments = function.get("arguments")
        if not isinstance(arguments, dict):
            self.fail(f"{where}.arguments", f"{type(arguments).__name__} arguments (transformers raises on "
                                            ".items(); pass a mapping)")
            return
        for key, value in arguments.items():
            at = f"{where}.arguments.{key}"
            if isinstance(value, dict):
                self.json_value(at, value)
            elif isinstance(value, (list, tuple)):
                self.json_value(at, value)
                if _runtime_repr(value) != str(list(value)):
                    self.fail(at, "a list whose Python str() the runtime's | string prints differently "
                                  "(mappings, quotes, tabs or other escapes in its strings)")
            elif value is None or isinstance(value, (str, bool, int, float)):
                self.number(at, value)
            else:
                self.fail(at, f"{type(value).__name__} value (not JSON)")

    def assistant(self, where: str, message: dict[str, Any], content: str | None, past: bool) -> None:
        """``past``: the template drops this turn's thinking."""
        if self.template is LFM2_5_MOE:
            if "thinking" in message and not isinstance(message["thinking"], str):
                self.fail(f"{where}.thinking", "not a string (transformers raises)")
            calls = message.get("tool_calls")
            if calls is not None:
                if not isinstance(calls, (list, tuple)):
                    self.fail(f"{where}.tool_calls", "not a list")
                else:
                    for j, call in enumerate(calls):
                        self.tool_call(f"{where}.tool_calls[{j}]", call)
        if past and content is not None:
            self.past_thinking(f"{where}.content", content)


def unsupported(messages: Messages, tools: Sequence[Any] | None = None,
                template: Lfm2Template = LFM2) -> list[str]:
    """Why the runtime's rendering of this conversation (``template``'s runtime form, run without
    ``keep_past_thinking``/``preserve_thinking``) may differ from transformers' (or transformers
    raises, where the runtime renders silently); empty when it renders identically (as measured by
    tests/test_lfm2_chat_template.py)."""
    check = _Checker(template)
    if not check.start(messages, tools):
        return check.reasons
    turns: list[tuple[str, dict[str, Any]]] = []
    for i, given in enumerate(messages):
        where = f"messages[{i}]"
        message = check.as_message(where, given)
        if message is None:
            continue
        if not isinstance(message.get("role"), str):
            check.fail(where, "a role that is not a string (transformers raises)")
            continue
        if i == 0 and message["role"] == "system":
            system = message.get("content")
            if template is LFM2_5_MOE:
                if system:
                    check.content(f"{where}.content", system)
            elif system is not None and not isinstance(system, str):
                check.fail(f"{where}.content", "a system message whose content is not a string (transformers raises)")
            continue
        turns.append((where, message))
    roles = [message["role"] for _, message in turns]
    last_user = max((k for k, role in enumerate(roles) if role == "user"), default=-1)
    last_assistant = max((k for k, role in enumerate(roles) if role == "assistant"), default=-1)
    for k, (where, message) in enumerate(turns):
        if "content" not in message and template is not LFM2_5_MOE:
            check.fail(where, "a message without content (transformers raises)")
            continue
        content = message.get("content")
        rendered = check.content(f"{where}.content", content) if template is not LFM2_5_MOE or content else ""
        if message["role"] != "assistant":
            continue
        past = k <= last_user if template is LFM2_5_MOE else (template is LFM2_5_INSTRUCT and k != last_assistant)
        check.assistant(where, message, rendered, past)
    for j, tool in enumerate(tools or ()):
        if not isinstance(tool, str):
            check.json_value(f"tools[{j}]", tool)
    return check.reasons


def check_conversation(messages: Messages, tools: Sequence[Any] | None = None, template: Lfm2Template = LFM2) -> None:
    """Raise InputError naming what the runtime would render differently from transformers."""
    raise_unsupported(unsupported(messages, tools, template))


def hf_render(tokenizer: Any, template: str, messages: Messages, thinking: bool,
              tools: Sequence[dict[str, Any]] | None = None) -> str:
    """transformers' rendering, generation prompt on (LFM2's templates read no thinking switch;
    ``thinking`` is accepted for ``compare_renderings``)."""
    return transformers_render(tokenizer, template, messages, tools, {})
