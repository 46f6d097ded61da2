"""Qwen3.5's chat template for MNN's runtime, and what of it the runtime cannot render as transformers does.

MNN 3.6.1 renders ``llm_config.json``'s ``jinja.chat_template`` with its own Jinja engine
(``transformers/llm/engine/src/tokenizer/jinja.hpp``); what a template sees there is described in
llmexport.models.chat_templates and docs/chat-templates.md (``messages`` from
``Llm.apply_chat_template``, rich messages as role ``"json"``; ``tools`` and ``enable_thinking``
only through ``jinja.context``).

Qwen3.5's own template (``QWEN3_5_TEMPLATE_SHA256``, 7,756 characters: HF ``Qwen/Qwen3.5-4B`` as
vendored in llama.cpp's ``models/templates/Qwen3.5-4B.jinja``) renders unchanged in that engine for
plain turns, system messages, thinking in history (dropped before the last user query, kept after
it), ``reasoning_content`` and image/video parts. What does not (``REWRITES``):

* ``tojson`` (tool declarations, mapping/list tool-call arguments): the runtime orders keys by a
  fixed priority (type, function, name, description, parameters, properties, required, enum) and
  then by bytes, transformers keeps insertion order. The runtime form prints JSON with a recursive
  macro over ``| items``, which visits a mapping in insertion order in both engines (the runtime
  stores mappings as RapidJSON objects), with ``tojson`` only for keys and scalars;
* ``loop.previtem`` / ``loop.nextitem`` do not exist in the runtime (tool responses lost their
  ``<|im_start|>user`` opener): ``messages[loop.index0 - 1]`` / ``messages[loop.index0 + 1]``;
* ``trim`` strips only space/tab/CR/LF in the runtime: ``.strip(...)`` with the ASCII whitespace
  Python strips.

What stays different is refused by ``unsupported`` / ``check_conversation`` with a reason (the
engine's number and whitespace limits, as for Gemma4's: llmexport.models.chat_templates; control
characters whose JSON escape differs in case; and what transformers itself rejects: the runtime
has no ``raise_exception`` and renders those conversations silently). Thinking is
``enable_thinking``: undefined or true (the template's default) opens ``<think>\\n``; false writes
an empty ``<think>\\n\\n</think>\\n\\n``. The turn ends with ``<|im_end|>``, the token the runtime
must stop on; the template uses neither ``bos_token`` nor ``eos_token``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from llmexport.models.chat_templates import (
    WS_LITERAL,
    ChatCase,
    ChatTemplateReport,
    ConversationChecker,
    HfRender,
    Messages,
    Rewrite,
    RuntimeChatTemplate,
    RuntimeRender,
    apply_rewrites,
    choose_runtime_template,
    compare_renderings,
    jinja_block,
    json_macro,
    json_template_warnings,
    raise_unsupported,
    template_sha256,
    transformers_render,
    trim_rewrite,
)

#: SHA-256 of Qwen3.5's chat template (llama.cpp's ``models/templates/Qwen3.5-4B.jinja``, 7,756
#: characters), trailing whitespace removed
QWEN3_5_TEMPLATE_SHA256 = "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715"

#: the token that ends every turn (the runtime's stop token; ``jinja.eos``)
END_OF_TURN = "<|im_end|>"

#: JSON as transformers' ``tojson`` prints it; prepended to the template
JSON_MACRO = json_macro("qwen_json")


def _strip(expr: str, count: int = 1, before: str = "") -> Rewrite:
    return trim_rewrite(f"{before}{expr}|trim", f"{before}{expr}.strip({WS_LITERAL})", count)


REWRITES: tuple[Rewrite, ...] = (
    Rewrite("the runtime's tojson reorders keys (priority list, then bytes); qwen_json keeps insertion order",
            "{{- tool | tojson }}", "{{- qwen_json(tool) }}"),
    Rewrite("the runtime's tojson reorders keys (priority list, then bytes); qwen_json keeps insertion order",
            "args_value | tojson | safe if", "qwen_json(args_value) if"),
    Rewrite("loop.previtem is undefined in the runtime",
            "loop.previtem and loop.previtem.role", "not loop.first and messages[loop.index0 - 1].role"),
    Rewrite("loop.nextitem is undefined in the runtime",
            "loop.nextitem.role", "messages[loop.index0 + 1].role"),
    _strip("render_content(messages[0].content, false, true)", count=2),
    _strip("render_content(message.content, false)"),
    _strip("render_content(message.content, true)"),
    _strip("reasoning_content", before="= "),
    _strip("content", before="if "),
)


def is_qwen3_5_template(template: str) -> bool:
    """True for the exact template the rewrites were proven on (trailing whitespace aside)."""
    return template_sha256(template) == QWEN3_5_TEMPLATE_SHA256


def derive_runtime_template(source: str) -> str:
    """``JSON_MACRO`` + ``source`` with every ``REWRITES`` entry applied; raises
    TemplateNotDerivable when one of them does not occur exactly as often as expected."""
    return JSON_MACRO + apply_rewrites(source, REWRITES)


def runtime_chat_template(checkpoint_template: str | None) -> RuntimeChatTemplate:
    """What to write for a Qwen3.5 checkpoint's template. ``kind``: ``"qwen3_5"`` (the proven
    template, derived), ``"derived"`` (the rewrites apply but the text differs: not proven),
    ``"checkpoint"`` (passed through, with the runtime-difference lint as notes), ``"none"``
    (no template: nothing is written, the runtime falls back to the tokenizer file's)."""
    if not checkpoint_template:
        return RuntimeChatTemplate("", "none", ("the checkpoint has no chat template",))
    return choose_runtime_template(checkpoint_template, derive_runtime_template, QWEN3_5_TEMPLATE_SHA256,
                                   "qwen3_5", "Qwen3.5", json_template_warnings)


def qwen3_5_jinja(checkpoint: dict[str, str] | None) -> dict[str, Any] | None:
    """``llm_config.json``'s ``jinja`` block for a Qwen3.5 checkpoint (``checkpoint``:
    ``DecoderFamily.checkpoint_chat_template()``, whose ``bos`` is kept): the runtime form of its
    template and ``eos`` = ``<|im_end|>`` (the template uses neither); None without a template.
    ``enable_thinking`` (``jinja.context``) comes from the export's options (``mnn.config.llm_config``)."""
    return jinja_block(checkpoint, runtime_chat_template((checkpoint or {}).get("chat_template")), END_OF_TURN)


# --- conversations --------------------------------------------------------------------------

_ROLES = ("system", "user", "assistant", "tool")


class _Checker(ConversationChecker):
    def content(self, where: str, content: Any, system: bool) -> str | None:
        """What the template's render_content makes of ``content`` (None: transformers raises)."""
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        parts = self.parts(where, content)
        if parts is None:
            return None
        out = []
        for at, part in parts:
            kind = part.get("type")
            if "image" in part or "image_url" in part or kind == "image" or "video" in part or kind == "video":
                if system:
                    self.fail(at, "an image or video in the system message (transformers raises)")
                    return None
                video = not ("image" in part or "image_url" in part or kind == "image")
                out.append("<|vision_start|><|video_pad|><|vision_end|>" if video
                           else "<|vision_start|><|image_pad|><|vision_end|>")
            elif "text" in part:
                if not isinstance(part["text"], str):
                    self.fail(f"{at}.text", f"{type(part['text']).__name__} text (the engines print it differently)")
                    return None
                out.append(part["text"])
            else:
                self.fail(at, "a part without text, image or video (transformers raises)")
                return None
        return "".join(out)

    def assistant(self, where: str, message: dict[str, Any], content: str, thinking_kept: bool) -> None:
        """``thinking_kept``: the turn comes after the last user query (its reasoning is rendered)."""
        self.trimmed(f"{where}.content", content)
        content = content.strip()
        reasoning = message.get("reasoning_content")
        if not isinstance(reasoning, str):
            reasoning = ""
            if "</think>" in content:
                reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                content = content.split("</think>")[-1].lstrip("\n")
        if thinking_kept:
            self.trimmed(f"{where}.reasoning", reasoning)
        self.trimmed(f"{where}.content", content)  # the tool-call branch trims it again
        calls = message.get("tool_calls")
        if calls is None:
            return
        if not isinstance(calls, (list, tuple)):
            self.fail(f"{where}.tool_calls", "not a list")
            return
        for j, call in enumerate(calls):
            self.tool_call(f"{where}.tool_calls[{j}]", call)

    def tool_call(self, where: str, call: Any) -> None:
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            self.fail(where, "a tool call needs a name (a string)")
            return
        if "arguments" not in function:
            return
        arguments = function["arguments"]
        if not isinstance(arguments, dict):
            self.fail(f"{where}.arguments", f"{type(arguments).__name__} arguments (transformers raises on "
                                            "| items; pass a mapping)")
            return
        for key, value in arguments.items():
            at = f"{where}.arguments.{key}"
            if not isinstance(key, str):
                self.fail(at, "a non-string argument name")
            elif isinstance(value, (dict, list, tuple)):
                self.json_value(at, value)
            elif value is None or isinstance(value, (str, bool, int, float)):
                self.number(at, value)
            else:
                self.fail(at, f"{type(value).__name__} value (not JSON)")


def unsupported(messages: Messages, tools: Sequence[dict[str, Any]] | None = None) -> list[str]:
    """Why the runtime's rendering of this conversation (derived Qwen3.5 template) may differ from
    transformers' (or transformers raises, where the runtime renders silently); empty when it
    renders identically (as measured by tests/test_qwen3_5_chat_template.py)."""
    check = _Checker()
    if not check.start(messages, tools):
        return check.reasons
    last_query = None
    assistants = []
    for i, given in enumerate(messages):
        where = f"messages[{i}]"
        message = check.as_message(where, given)
        if message is None:
            continue
        role = message.get("role")
        if role not in _ROLES:
            check.fail(where, f"role {role!r} (transformers raises)")
            continue
        if role == "system" and i:
            check.fail(where, "a system message after the first (transformers raises)")
        content = check.content(f"{where}.content", message.get("content"), role == "system")
        if content is None:
            continue
        if role == "assistant":
            assistants.append((i, where, message, content))
        else:
            check.trimmed(f"{where}.content", content)
        if role == "user":
            stripped = content.strip()
            if not (stripped.startswith("<tool_response>") and stripped.endswith("</tool_response>")):
                last_query = i
    for i, where, message, content in assistants:
        check.assistant(where, message, content, thinking_kept=last_query is not None and i > last_query)
    if messages and last_query is None:
        check.fail("messages", "no user query (transformers raises)")
    if tools:
        check.json_value("tools", list(tools))
    return check.reasons


def check_conversation(messages: Messages, tools: Sequence[dict[str, Any]] | None = None) -> None:
    """Raise InputError naming what the runtime would render differently from transformers."""
    raise_unsupported(unsupported(messages, tools))


def hf_render(tokenizer: Any, template: str, messages: Messages, thinking: bool,
              tools: Sequence[dict[str, Any]] | None = None) -> str:
    """transformers' rendering with ``enable_thinking`` set (the Qwen3.5 template's default,
    undefined, means on), generation prompt on."""
    return transformers_render(tokenizer, template, messages, tools, {"enable_thinking": thinking})


def compare_chat_template(cases: Iterable[ChatCase], render_hf: HfRender, render_runtime: RuntimeRender,
                          thinking_modes: Sequence[bool] = (False, True)) -> ChatTemplateReport:
    """``compare_renderings`` classified by this template's ``unsupported``: every case in every
    thinking mode by transformers (``render_hf(messages, thinking, tools)``, e.g. ``hf_render``
    bound to a tokenizer and the checkpoint's template) and by the runtime (e.g.
    ``runtime_renderer(llm)`` of llmexport.models.chat_templates)."""
    return compare_renderings(cases, unsupported, render_hf, render_runtime, thinking_modes)
