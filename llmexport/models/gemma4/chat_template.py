"""Gemma4's chat template for MNN's runtime, and the check that it renders what transformers renders.

What MNN 3.6.1's engine gives a template and renders differently from Jinja2 is in
llmexport.models.chat_templates (and docs/chat-templates.md); this module holds Gemma4's facts.

Gemma4's own template (``GEMMA4_TEMPLATE_SHA256``, 12,045 characters) mostly renders unchanged in
that engine, but not all of it: ``| dictsort`` and ``| default(...)`` are unknown filters there
(passed through: ``for key, value in d | dictsort`` yields keys and an undefined value, so tool
call arguments render as ``{}``), macro parameter defaults are ignored (``escape_keys=True``),
``x if c`` without ``else`` always yields ``x``, ``map('upper')`` maps an attribute, ``none``
prints ``null``, and ``trim`` strips only space/tab/CR/LF (``True``/``False``/``None`` are
undefined names too, harmless where this template uses them). ``derive_runtime_template``
rewrites exactly the harmful constructs (``REWRITES``);
the result renders what transformers renders for the conversations ``unsupported`` accepts, which
tests/test_gemma4_chat_template.py measures on a corpus. What stays different is refused by
``unsupported``/``check_conversation`` with a reason: floats the runtime's JSON parser
(RapidJSON, normal precision) may change, mapping keys whose byte order differs from dictsort's
case-insensitive order, non-ASCII whitespace at the edges of trimmed text, values transformers
itself would render as Python reprs.

Thinking is the template's ``enable_thinking`` variable: it is written to ``jinja.context`` at
export (``--chat_thinking``; off, the template's default, ends the generation prompt with an
empty thought channel ``<|channel>thought\\n<channel|>``) and can be changed at run time with
``set_config``.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Iterable, Sequence

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
    placeholder,
    raise_unsupported,
    runtime_template_warnings,
    template_sha256,
    transformers_render,
    trim_rewrite,
)

log = logging.getLogger(__name__)

#: SHA-256 of Gemma4's chat template as HF's tokenizer ships it (``tokenizer.chat_template`` of
#: llama.cpp's ``ggml-vocab-gemma-4.gguf``, 12,045 characters), trailing whitespace removed.
GEMMA4_TEMPLATE_SHA256 = "58c66fdee4afa29786fa0925a4c3659c8ebc28a2db93da6ae479d7d5886ce48f"

# The full HF Gemma4 template needs the rewrites below; without a checkpoint template this one
# renders system/user/assistant turns with string content (role "assistant" is written "model").
MINJA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|turn>model\n"
    "{% else %}<|turn>{{ message['role'] }}\n"
    "{% endif %}"
    "{{ message['content'] }}<turn|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def _keyed_loop(key: str, value: str, mapping: str) -> Rewrite:
    return Rewrite(
        "dictsort is unknown to the runtime (the loop would get keys and an undefined value); "
        "a loop over a mapping there visits its keys in sorted (byte) order",
        f"{{%- for {key}, {value} in {mapping} | dictsort -%}}",
        f"{{%- for {key} in {mapping} -%}}{{%- set {value} = {mapping}[{key}] -%}}")


def _trimmed(expr: str) -> Rewrite:
    # (the guard keeps Jinja2 from failing on a missing key, which the runtime reads as '')
    return trim_rewrite(f"{{{{- {expr} | trim -}}}}",
                        f"{{{{- {expr}.strip({WS_LITERAL}) if {expr} is string else '' -}}}}")


REWRITES: tuple[Rewrite, ...] = (
    _keyed_loop("key", "value", "properties"),
    _keyed_loop("item_key", "item_value", "value['items']"),
    _keyed_loop("key", "value", "argument"),
    _keyed_loop("key", "value", "function['arguments']"),
    _keyed_loop("key", "value", "tool_response['response']"),
    Rewrite("default() is unknown to the runtime, and a missing key reads as '' there",
            "tool_response['name'] | default('unknown')",
            "(tool_response['name'] if 'name' in tool_response else 'unknown')", count=2),
    Rewrite("macro parameter defaults are ignored by the runtime (escape_keys=True)",
            "format_argument(value['enum'])", "format_argument(value['enum'], escape_keys=true)"),
    Rewrite("macro parameter defaults are ignored by the runtime (escape_keys=True)",
            "{{ item_key }}:{{ format_argument(item_value) }}",
            "{{ item_key }}:{{ format_argument(item_value, escape_keys=true) }}"),
    Rewrite("map('upper') maps an attribute in the runtime, and | list is unknown there",
            "type:{{ format_argument(item_value | map('upper') | list) }}",
            "type:[{%- for t in item_value -%}<|\"|>{{- t | upper -}}<|\"|>{%- if not loop.last -%},{%- endif -%}"
            "{%- endfor -%}]"),
    Rewrite("'x if c' without else always yields x in the runtime",
            "{{- ',' if not loop.last -}}", "{{- ',' if not loop.last else '' -}}"),
    Rewrite("the runtime prints none as null, Jinja2 as None",
            "    {%- else -%}\n        {{- argument -}}\n",
            "    {%- elif argument is none -%}\n        {{- 'None' -}}\n    {%- else -%}\n        {{- argument -}}\n"),
    _trimmed("ns.result"),
    _trimmed("messages[0]['content']"),
    _trimmed("message['content']"),
    _trimmed("item['text']"),
)


def is_gemma4_template(template: str) -> bool:
    """True for the exact template the rewrites were proven on (trailing whitespace aside)."""
    return template_sha256(template) == GEMMA4_TEMPLATE_SHA256


def derive_runtime_template(source: str) -> str:
    """``source`` with every ``REWRITES`` entry applied; raises TemplateNotDerivable when one of
    them does not occur exactly as often as expected."""
    return apply_rewrites(source, REWRITES)


def runtime_chat_template(checkpoint_template: str | None) -> RuntimeChatTemplate:
    """What to write for a Gemma4 checkpoint's template. ``kind``: ``"gemma4"`` (Gemma4's own
    template, derived and proven on the test corpus), ``"derived"``, ``"checkpoint"`` (see
    ``choose_runtime_template``), ``"builtin"`` (no template in the checkpoint)."""
    if not checkpoint_template:
        return RuntimeChatTemplate(MINJA_CHAT_TEMPLATE, "builtin", (
            "the checkpoint has no chat template: the built-in one renders string turns only",))
    return choose_runtime_template(checkpoint_template, derive_runtime_template, GEMMA4_TEMPLATE_SHA256,
                                   "gemma4", "Gemma4", runtime_template_warnings)


def gemma4_jinja(checkpoint: dict[str, str] | None) -> dict[str, Any]:
    """``llm_config.json``'s ``jinja`` block: the runtime form of the checkpoint's chat template
    (``checkpoint``: ``DecoderFamily.checkpoint_chat_template()``) and bos/eos strings; the
    template's variables (``context``, e.g. ``enable_thinking``) come from the export's options
    (``mnn.config.llm_config``)."""
    chosen = runtime_chat_template((checkpoint or {}).get("chat_template"))
    for note in chosen.notes:
        log.warning("chat template: %s", note)
    return {"chat_template": chosen.template, "bos": "<bos>", "eos": "<turn|>"}


# --- conversations --------------------------------------------------------------------------

def _strip_thinking(text: str) -> str:
    parts = text.split("<channel|>")
    return "".join(p.split("<|channel>")[0] if "<|channel>" in p else p for p in parts)


class _Checker(ConversationChecker):
    def trimmed(self, where: str, text: Any) -> None:
        if not isinstance(text, str):
            self.fail(where, f"{type(text).__name__} where the template trims a string")
        else:
            super().trimmed(where, text)

    def mapping_keys(self, where: str, mapping: dict) -> list[str]:
        keys = list(mapping)
        if not all(isinstance(k, str) for k in keys):
            self.fail(where, "a mapping with non-string keys")
            return []
        if sorted(keys) != sorted(keys, key=str.lower):
            self.fail(where, f"keys {sorted(keys, key=str.lower)} sort differently by bytes (the runtime) "
                             "and case-insensitively (dictsort)")
        return keys

    def value(self, where: str, value: Any) -> None:
        """A value printed by the template's format_argument."""
        if value is None or isinstance(value, (bool, str)):
            return
        if isinstance(value, (int, float)):
            self.number(where, value)
        elif isinstance(value, dict):
            for key in self.mapping_keys(where, value):
                self.value(f"{where}.{key}", value[key])
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                self.value(f"{where}[{i}]", item)
        else:
            self.fail(where, f"{type(value).__name__} value (not JSON)")

    def message(self, i: int, message: Any, first: bool) -> None:
        where = f"messages[{i}]"
        message = self.as_message(where, message)
        if message is None:
            return
        role = message.get("role")
        if not isinstance(role, str):
            self.fail(where, "role is not a string")
            return
        content = message.get("content")
        if first and role in ("system", "developer"):
            if "content" in message:  # a missing key renders '' in both
                self.trimmed(f"{where}.content", content)
            return
        model = role in ("assistant", "model")
        if isinstance(content, str):
            self.trimmed(f"{where}.content", _strip_thinking(content) if model else content)
        elif isinstance(content, (list, tuple)):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "text" and "text" in part:
                    text = part["text"]
                    self.trimmed(f"{where}.content[{j}].text", _strip_thinking(text) if model and
                                 isinstance(text, str) else text)
        # other content (None, numbers, mappings) renders nothing in both engines
        for j, call in enumerate(message.get("tool_calls") or ()):
            self.tool_call(f"{where}.tool_calls[{j}]", call)
        for j, response in enumerate(message.get("tool_responses") or ()):
            self.tool_response(f"{where}.tool_responses[{j}]", response)

    def tool_call(self, where: str, call: Any) -> None:
        function = self.called_function(where, call)
        if function is None:
            return
        arguments = function.get("arguments")
        if isinstance(arguments, dict):  # other non-string arguments render nothing in both engines
            for key in self.mapping_keys(f"{where}.arguments", arguments):
                self.value(f"{where}.arguments.{key}", arguments[key])

    def tool_response(self, where: str, response: Any) -> None:
        if not isinstance(response, dict):
            self.fail(where, "a tool response that is not a dict")
            return
        if "name" in response and not isinstance(response["name"], str):
            self.fail(f"{where}.name", "not a string")
        if "response" not in response:
            self.fail(f"{where}.response", "missing (transformers renders an undefined value as [])")
            return
        body = response["response"]
        if isinstance(body, dict):
            for key in self.mapping_keys(f"{where}.response", body):
                self.value(f"{where}.response.{key}", body[key])
        else:
            self.value(f"{where}.response", body)

    def ascii_type(self, where: str, kind: Any) -> None:
        if kind is not None and not (isinstance(kind, str) and kind.isascii()):
            self.fail(where, "a type that is not an ASCII string (upper() differs)")

    def parameters(self, where: str, properties: Any) -> None:
        if not isinstance(properties, dict):
            self.fail(where, "properties that are not a mapping")
            return
        for key in self.mapping_keys(where, properties):
            spec = properties[key]
            at = f"{where}.{key}"
            if not isinstance(spec, dict):
                self.fail(at, "a property that is not a mapping")
                continue
            if not isinstance(spec.get("description", ""), str):
                self.fail(f"{at}.description", "not a string")
            self.ascii_type(f"{at}.type", spec.get("type"))
            if "enum" in spec:
                self.value(f"{at}.enum", spec["enum"])
            if isinstance(spec.get("properties"), dict):
                self.parameters(f"{at}.properties", spec["properties"])
            items = spec.get("items")
            if isinstance(items, dict):
                for item_key in self.mapping_keys(f"{at}.items", items):
                    item = items[item_key]
                    if item_key == "properties":
                        self.parameters(f"{at}.items.properties", item)
                    elif item_key == "type":
                        kinds = item if isinstance(item, list) else [item]
                        for kind in kinds:
                            self.ascii_type(f"{at}.items.type", kind)
                    elif item_key != "required":
                        self.value(f"{at}.items.{item_key}", item)

    def tool(self, i: int, tool: Any) -> None:
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            self.fail(where, "a tool needs function.name (a string)")
            return
        if not isinstance(function.get("description", ""), str):
            self.fail(f"{where}.description", "not a string")
        params = function.get("parameters")
        if isinstance(params, dict):
            if "properties" in params:
                self.parameters(f"{where}.parameters.properties", params["properties"])
            self.ascii_type(f"{where}.parameters.type", params.get("type"))
        response = function.get("response")
        if isinstance(response, dict):
            self.ascii_type(f"{where}.response.type", response.get("type"))


def unsupported(messages: Messages, tools: Sequence[dict[str, Any]] | None = None) -> list[str]:
    """Why the runtime's rendering of this conversation (derived Gemma4 template) may differ from
    transformers'; empty when it renders identically (as measured by the test corpus)."""
    check = _Checker()
    check.texts([list(messages), list(tools or ())])
    if not messages:
        check.fail("messages", "empty (the template reads messages[0])")
    for i, message in enumerate(messages):
        check.message(i, message, first=i == 0)
    for i, tool in enumerate(tools or ()):
        check.tool(i, tool)
    try:
        json.dumps(list(messages), default=placeholder, allow_nan=False)
        json.dumps(list(tools or ()), allow_nan=False)
    except (TypeError, ValueError) as exc:
        check.fail("conversation", f"not JSON-serialisable for the runtime ({exc})")
    return check.reasons


def check_conversation(messages: Messages, tools: Sequence[dict[str, Any]] | None = None) -> None:
    """Raise InputError naming what the runtime would render differently from transformers."""
    raise_unsupported(unsupported(messages, tools))


def hf_render(tokenizer: Any, template: str, messages: Messages, thinking: bool,
              tools: Sequence[dict[str, Any]] | None = None) -> str:
    """transformers' rendering (``tokenizer.apply_chat_template``, generation prompt on); thinking
    off leaves ``enable_thinking`` undefined, the template's default."""
    return transformers_render(tokenizer, template, messages, tools, {"enable_thinking": True} if thinking else {})


def compare_chat_template(cases: Iterable[ChatCase], render_hf: HfRender, render_runtime: RuntimeRender,
                          thinking_modes: Sequence[bool] = (False, True)) -> ChatTemplateReport:
    """``compare_renderings`` classified by this template's ``unsupported``: every case in every
    thinking mode by transformers (``render_hf(messages, thinking, tools)``, e.g. ``hf_render``
    bound to a tokenizer and the checkpoint's template) and by the runtime (e.g.
    ``runtime_renderer(llm)``)."""
    return compare_renderings(cases, unsupported, render_hf, render_runtime, thinking_modes)


def standard_cases() -> list[ChatCase]:
    """A small corpus for a verifier: the template's branches with ordinary content (system and
    developer turns, history with thoughts, tool declarations, calls and responses, image and audio
    parts, whitespace the template trims). Every case is supported (``unsupported`` is empty)."""
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "hours": {"type": "array", "items": {"type": "integer"}}}, "required": ["city"]}}}
    call = {"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "hours": [9, 12], "unit": "celsius", "exact": True,
                                             "hint": None, "where": {"lat": 48.5, "lon": 2.25}}}}]}
    response = {"role": "tool", "tool_responses": [{"name": "get_weather", "response": {
        "temperature": 21, "conditions": "sunny", "hourly": [20, 21, 22]}}]}
    return [
        ChatCase("user", [{"role": "user", "content": "Hello!"}]),
        ChatCase("system", [{"role": "system", "content": " You are terse. "},
                            {"role": "user", "content": "Wie geht's? 你好 😀"}]),
        ChatCase("multi_turn", [{"role": "developer", "content": "One word."},
                                {"role": "user", "content": "Capital of France?"},
                                {"role": "assistant", "content": "<|channel>thought\nEasy.<channel|>Paris"},
                                {"role": "user", "content": "And of\tGermany?\n"}]),
        ChatCase("tools", [{"role": "user", "content": "Weather in Paris?"}, call, response], tools=[tool]),
        ChatCase("tool_answer", [{"role": "user", "content": "Weather?"}, call, response,
                                 {"role": "assistant", "content": "Sunny, 21 C."}, {"role": "user", "content": "Ok"}]),
        ChatCase("media", [{"role": "user", "content": [
            {"type": "text", "text": "Compare "}, {"type": "image"}, {"type": "text", "text": "with"},
            {"type": "audio"}]}]),
    ]
