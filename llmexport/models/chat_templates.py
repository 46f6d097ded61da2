"""Chat templates in MNN 3.6.1's runtime versus transformers' Jinja2: what every family's template shares.

MNN's runtime (3.6.1) renders ``llm_config.json``'s ``jinja.chat_template`` with its own small
Jinja engine (``transformers/llm/engine/src/tokenizer/jinja.hpp``; ``Tokenizer::apply_chat_template``
in ``tokenizer.cpp`` feeds it). The variables a template sees there:

* ``messages``: from ``Llm.apply_chat_template(list of {"role", "content"} dicts)``, content a
  string; a message whose role is ``"json"`` has its content parsed as a JSON object and used as
  the whole message (the only way to pass tool calls, tool responses or typed content parts:
  ``runtime_messages``);
* ``bos_token`` (the tokenizer file's bos string) and ``eos_token`` (``jinja.eos``);
* ``add_generation_prompt``: always true through ``Llm.apply_chat_template``;
* every key of ``jinja.context`` (``llm_config.json``, or later ``Llm.set_config({"jinja":
  {"context": ...}})``, which merges): ``enable_thinking`` and ``tools`` reach the template only
  this way; the call itself passes no tools (``runtime_context``).

What that engine renders differently from Jinja2 (the families' templates meet these): ``| dictsort``,
``| default(...)`` and several other filters are unknown (passed through: ``for key, value in d |
dictsort`` yields keys and an undefined value); macro parameter defaults are ignored; ``x if c``
without ``else`` always yields ``x``; ``map('upper')`` maps an attribute; ``none`` prints ``null``;
``trim`` strips only space/tab/CR/LF (``ASCII_WHITESPACE``); ``True``/``False``/``None`` are
undefined names; ``tojson`` orders keys by a fixed priority, then by bytes, and writes control
characters' ``\\u`` escapes in upper case; ``loop.previtem``/``loop.nextitem`` do not exist; ``for k
in m`` visits a mapping's keys in byte order, ``m | items`` in insertion order; JSON numbers pass
RapidJSON (integers exact in ``INT_RANGE``, floats exact only where ``float_ok``); a NUL cuts the text.

A family's module holds its template's facts: the proven template's hash, its ``Rewrite`` list,
the rules of its ``unsupported`` conversation check, its ``jinja`` block. This module holds the
rest: applying rewrites (``apply_rewrites``), choosing what to write (``choose_runtime_template``),
the lint for unknown templates, the JSON limits and the checker base, and the comparison of
transformers' renderings with the runtime's (``compare_renderings``, ``runtime_renderer``).
docs/chat-templates.md has the measurements.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from llmexport.errors import InputError

log = logging.getLogger(__name__)

#: the ASCII characters Python's ``str.strip()`` removes (what Jinja2's ``trim`` removes, beside
#: non-ASCII whitespace); the runtime's ``trim`` removes only space, tab, CR and LF
ASCII_WHITESPACE = "".join(c for c in map(chr, range(128)) if c.isspace())
#: ``ASCII_WHITESPACE`` as a Jinja string literal both engines read alike: escapes for tab/LF/CR/FF
#: (Jinja2 would turn a raw CR into LF), the others raw (MNN's lexer knows no \v or \x escapes)
WS_LITERAL = "' \\t\\n\\r\\f\x0b\x1c\x1d\x1e\x1f'"


# --- the template ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Rewrite:
    """Replace ``old`` (which must occur exactly ``count`` times) with ``new``."""

    why: str
    old: str
    new: str
    count: int = 1


def trim_rewrite(old: str, new: str, count: int = 1) -> Rewrite:
    """A ``| trim`` replaced by ``.strip(WS_LITERAL)`` (``new`` writes it)."""
    return Rewrite("the runtime's trim strips only space/tab/CR/LF; strip() with the ASCII whitespace set",
                   old, new, count)


class TemplateNotDerivable(ValueError):
    """The source template lacks a construct the rewrites expect (it is not the family's template)."""


def apply_rewrites(source: str, rewrites: Iterable[Rewrite]) -> str:
    """``source`` with every rewrite applied in order; raises TemplateNotDerivable when one of them
    does not occur exactly as often as expected."""
    out = source
    for rewrite in rewrites:
        found = out.count(rewrite.old)
        if found != rewrite.count:
            raise TemplateNotDerivable(f"expected {rewrite.count} x {rewrite.old!r}, found {found}")
        out = out.replace(rewrite.old, rewrite.new)
    return out


def json_macro(name: str) -> str:
    """A macro ``name(v)`` printing JSON as transformers' ``tojson`` does (``json.dumps``: insertion
    order, ", " and ": "), written with what both engines share (``| items`` visits a mapping in
    insertion order in both; ``tojson`` only for keys and scalars); prepended to a template whose
    ``x | tojson`` a rewrite turns into ``name(x)``."""
    return (
        f"{{%- macro {name}(v) -%}}"
        "{%- if v is mapping -%}{{- '{' -}}"
        f"{{%- for k, x in v | items -%}}{{{{- k | tojson -}}}}{{{{- ': ' -}}}}{{{{- {name}(x) -}}}}"
        "{%- if not loop.last -%}{{- ', ' -}}{%- endif -%}{%- endfor -%}{{- '}' -}}"
        "{%- elif v is string -%}{{- v | tojson -}}"
        "{%- elif v is sequence -%}{{- '[' -}}"
        f"{{%- for x in v -%}}{{{{- {name}(x) -}}}}"
        "{%- if not loop.last -%}{{- ', ' -}}{%- endif -%}{%- endfor -%}"
        "{{- ']' -}}"
        "{%- else -%}{{- v | tojson -}}{%- endif -%}"
        "{%- endmacro -%}\n"
    )


def template_sha256(template: str) -> str:
    return hashlib.sha256(template.rstrip().encode("utf-8")).hexdigest()


#: constructs the runtime's engine (MNN 3.6.1) does not render like Jinja2 (a heuristic lint)
_LINT = (
    (re.compile(r"\|\s*dictsort\b"), "dictsort filter (unknown to the runtime)"),
    (re.compile(r"\|\s*default\s*\("), "default() filter (unknown to the runtime)"),
    (re.compile(r"\|\s*(join|sort|unique|reverse|first|last|list|selectattr|rejectattr|batch)\b"),
     "a filter the runtime does not know (passed through unchanged)"),
    (re.compile(r"\{%-?\s*macro\s+\w+\([^)]*="), "macro parameter default (ignored by the runtime)"),
    (re.compile(r"(?<![\w'\"])(True|False|None)(?![\w'\"])"), "True/False/None (undefined names in the runtime)"),
    (re.compile(r"\.items\(\)"), "dict.items() (unknown method in the runtime)"),
)


def runtime_template_warnings(template: str) -> list[str]:
    """Constructs in ``template`` that MNN 3.6.1's engine renders differently (heuristic)."""
    return [why for pattern, why in _LINT if pattern.search(template)]


def json_and_loop_warnings(template: str) -> list[str]:
    """The lint's second part (Qwen3.5's notes add it; Gemma4's predate it): ``tojson`` and
    ``loop.previtem``/``loop.nextitem``."""
    found = []
    if "tojson" in template:
        found.append("tojson (the runtime reorders mapping keys)")
    if "loop.previtem" in template or "loop.nextitem" in template:
        found.append("loop.previtem/nextitem (undefined in the runtime)")
    return found


def json_template_warnings(template: str) -> list[str]:
    """The whole lint (``runtime_template_warnings`` + ``json_and_loop_warnings``) for a template
    passed through in place of Qwen3.5's or LFM2's."""
    return runtime_template_warnings(template) + json_and_loop_warnings(template)


@dataclass(frozen=True)
class RuntimeChatTemplate:
    """The template written to ``jinja.chat_template`` and where it came from. ``kind``: the
    family's name (its own template, derived and proven on the test corpus), ``"derived"`` (an
    unknown template the rewrites applied to: not proven), ``"checkpoint"`` (an unknown template
    passed through), or what the family writes without a template (``"builtin"``, ``"none"``)."""

    template: str
    kind: str
    notes: tuple[str, ...] = ()


def choose_runtime_template(checkpoint_template: str, derive: Callable[[str], str], proven_sha256: str,
                            kind: str, family: str, lint: Callable[[str], list[str]]) -> RuntimeChatTemplate:
    """What to write for a checkpoint's (non-empty) template: ``derive(template)`` as ``kind`` when
    the template is the proven one (``proven_sha256``), as ``"derived"`` with a note naming
    ``family`` when only the rewrites apply; else the template as it is, with ``lint``'s notes."""
    try:
        derived = derive(checkpoint_template)
    except TemplateNotDerivable:
        return RuntimeChatTemplate(checkpoint_template, "checkpoint", tuple(
            f"chat template passed through; it uses {w}; check with --verify" for w in lint(checkpoint_template)))
    if template_sha256(checkpoint_template) == proven_sha256:
        return RuntimeChatTemplate(derived, kind)
    return RuntimeChatTemplate(derived, "derived", (
        f"the checkpoint's chat template is not the {family} template the runtime rewrite was proven on "
        f"(sha256 {template_sha256(checkpoint_template)[:12]}...); check with --verify",))


def jinja_block(checkpoint: dict[str, str] | None, chosen: RuntimeChatTemplate, eos: str) -> dict[str, Any] | None:
    """``llm_config.json``'s ``jinja`` block: the checkpoint's (``bos`` kept) with ``chosen``'s
    template and ``eos``, ``chosen``'s notes logged; None when there is no template."""
    for note in chosen.notes:
        log.warning("chat template: %s", note)
    if chosen.kind == "none":
        return None
    return {**(checkpoint or {}), "chat_template": chosen.template, "eos": eos}


# --- conversations --------------------------------------------------------------------------

Messages = Sequence[dict[str, Any]]
Tools = Sequence[dict[str, Any]]

#: the integers RapidJSON keeps exact; others become doubles
INT_RANGE = (-(2 ** 63), 2 ** 64)


def float_ok(x: float) -> bool:
    """True where the runtime's JSON parser/printer keeps ``x``'s digits. Measured on MNN 3.6.1
    (tests/test_gemma4_chat_template.py): integral values below 1e15 and multiples of 1/256 below
    1e6 print as Python prints them; ~22% of other floats change a digit."""
    if not math.isfinite(x) or "e" in repr(x):
        return False
    return (x.is_integer() and abs(x) < 1e15) or ((x * 256).is_integer() and abs(x) < 1e6)


def json_escape_differs(text: str) -> bool:
    """json.dumps writes \\u001f, RapidJSON \\u001F: control characters without a short escape
    whose hex code has a letter."""
    return any(ord(c) < 0x20 and c not in "\b\t\n\f\r" and f"{ord(c):x}" != f"{ord(c):X}" for c in text)


def strings(value: Any) -> Iterable[str]:
    """Every string in nested dicts (keys and values), lists and tuples."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from strings(key)
            yield from strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from strings(item)


def placeholder(value: Any) -> str:
    """``json.dumps``'s default: media objects in content parts (images, arrays), whose part the
    templates read only the type of."""
    return f"<{type(value).__name__}>"


def without_none(message: dict[str, Any]) -> dict[str, Any]:
    """The message without its None-valued keys: transformers drops them before rendering
    (content=None from OpenAI-style APIs)."""
    return {key: value for key, value in message.items() if value is not None}


class ConversationChecker:
    """Collects the reasons a conversation renders differently; a family's checker adds its
    template's rules."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def fail(self, where: str, why: str) -> None:
        self.reasons.append(f"{where}: {why}")

    def texts(self, value: Any) -> None:
        """The first string in ``value`` the runtime cannot take whole (NUL, lone surrogate)."""
        for text in strings(value):
            if "\x00" in text:
                self.fail("conversation", "a NUL character (the runtime cuts the text there)")
                break
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                self.fail("conversation", "a string that is not valid Unicode (lone surrogate)")
                break

    def called_function(self, where: str, call: Any) -> dict[str, Any] | None:
        """A tool call's ``function`` mapping; None (and a reason) when it has no string ``name``."""
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            self.fail(where, "a tool call needs function.name, a string")
            return None
        return function

    def as_message(self, where: str, message: Any) -> dict[str, Any] | None:
        """The message as transformers renders it (None-valued keys dropped); None when it is no dict."""
        if not isinstance(message, dict):
            self.fail(where, "not a dict")
            return None
        message = without_none(message)
        if message.get("role") == "json":
            self.fail(where, "role 'json' means 'parse content as the message' to the runtime")
        return message

    def start(self, messages: Messages, tools: Sequence[Any] | None) -> bool:
        """The checks every conversation gets first: JSON-serialisable (False, with the reason, when
        not: nothing else can be checked), no NUL, no empty message list."""
        try:
            text = json.dumps([list(messages), list(tools or ())], default=placeholder, allow_nan=False,
                              ensure_ascii=False)
            text.encode("utf-8")
        except (TypeError, ValueError) as exc:  # UnicodeEncodeError is a ValueError
            self.reasons.append(f"conversation: not JSON-serialisable for the runtime ({exc})")
            return False
        self.texts([list(messages), list(tools or ())])  # valid Unicode already: a NUL is all it can find
        if not messages:
            self.fail("messages", "empty (transformers raises)")
        return True

    def parts(self, where: str, content: Any) -> list[tuple[str, dict[str, Any]]] | None:
        """``content``'s typed parts, each with its place; None (a reason added) when it is no list
        of mappings (transformers raises)."""
        if not isinstance(content, (list, tuple)):
            self.fail(where, f"{type(content).__name__} content (transformers raises)")
            return None
        found = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                self.fail(f"{where}[{j}]", "a content part that is not a mapping")
                return None
            found.append((f"{where}[{j}]", part))
        return found

    def json_value(self, where: str, value: Any) -> None:
        """A value printed as JSON (``json_macro``: tool declarations, mapping arguments, parts)."""
        if isinstance(value, str):
            if json_escape_differs(value):
                self.fail(where, "a control character whose JSON escape the runtime writes in upper case")
        elif isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    self.fail(where, "a mapping with non-string keys")
                    return
                self.json_value(f"{where}.{key}", key)
                self.json_value(f"{where}.{key}", item)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                self.json_value(f"{where}[{i}]", item)
        elif value is None or isinstance(value, (bool, int, float)):
            self.number(where, value)
        else:
            self.fail(where, f"{type(value).__name__} value (not JSON)")

    def trimmed(self, where: str, text: str) -> None:
        if text.strip() != text.strip(ASCII_WHITESPACE):
            self.fail(where, "non-ASCII whitespace at an edge: transformers strips it (str.strip), "
                             "the runtime's engine does not")

    def number(self, where: str, value: Any) -> None:
        """A JSON number the runtime may not print as Python does (anything else passes)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return
        if isinstance(value, int) and not INT_RANGE[0] <= value < INT_RANGE[1]:
            self.fail(where, f"integer {value} outside the runtime's 64-bit range")
        elif isinstance(value, float) and not float_ok(value):
            self.fail(where, f"float {value!r}: the runtime's JSON parser/printer may change its digits "
                             "(exact: integral below 1e15, or a multiple of 1/256 below 1e6)")


def raise_unsupported(reasons: Sequence[str]) -> None:
    """Raise InputError naming what the runtime would render differently from transformers."""
    if reasons:
        raise InputError("the runtime's chat template would not render this conversation as transformers does: "
                         + "; ".join(reasons))


def runtime_messages(messages: Messages) -> list[dict[str, str]]:
    """``messages`` as ``Llm.apply_chat_template`` takes them: plain {"role", "content"} string
    pairs as they are, anything else as role "json" with the message as a JSON string. Keys whose
    value is None are dropped first, as transformers does."""
    out = []
    for message in map(without_none, messages):
        if set(message) == {"role", "content"} and all(isinstance(message[k], str) for k in ("role", "content")):
            out.append({"role": message["role"], "content": message["content"]})
        else:
            out.append({"role": "json", "content": json.dumps(message, ensure_ascii=False, default=placeholder)})
    return out


def runtime_context(thinking: bool, tools: Tools | None = None) -> dict[str, Any]:
    """``jinja.context`` for one rendering (``Llm.set_config({"jinja": {"context": ...}})``);
    ``tools`` is always set so that a merge clears an earlier conversation's tools."""
    return {"enable_thinking": bool(thinking), "tools": list(tools or [])}


def transformers_render(tokenizer: Any, template: str, messages: Messages, tools: Tools | None,
                        variables: dict[str, Any]) -> str:
    """transformers' rendering (``tokenizer.apply_chat_template``, generation prompt on) with the
    template's extra ``variables`` (a family's ``hf_render`` says which)."""
    text = tokenizer.apply_chat_template(list(messages), chat_template=template, tools=list(tools) if tools else None,
                                         tokenize=False, add_generation_prompt=True, **variables)
    assert isinstance(text, str)
    return text


# --- comparison -----------------------------------------------------------------------------

@dataclass(frozen=True)
class ChatCase:
    name: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class ChatResult:
    """One conversation in one thinking mode. ``status``: ``equal``, ``differs`` (a supported
    conversation rendered differently: a defect), ``refused`` (``unsupported`` names reasons;
    ``same`` says whether the two renderings happened to agree) or ``invalid`` (transformers
    itself raised)."""

    name: str
    thinking: bool
    status: str
    hf: str | None
    runtime: str | None
    reasons: tuple[str, ...] = ()

    @property
    def same(self) -> bool:
        return self.hf is not None and self.hf == self.runtime

    def first_difference(self) -> str:
        a, b = self.hf or "", self.runtime or ""
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return f"at {i}: transformers {a[max(0, i - 20):i + 40]!r} vs runtime {b[max(0, i - 20):i + 40]!r}"


@dataclass
class ChatTemplateReport:
    results: list[ChatResult] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def ok(self) -> bool:
        return self.count("differs") == 0

    def summary(self) -> str:
        refused_diff = sum(r.status == "refused" and not r.same for r in self.results)
        return (f"{len(self.results)} renderings: {self.count('equal')} identical, {self.count('differs')} different, "
                f"{self.count('refused')} refused ({refused_diff} of them do differ), {self.count('invalid')} invalid")


RuntimeRender = Callable[[list[dict[str, str]], dict[str, Any]], str]
HfRender = Callable[[Messages, bool, Sequence[dict[str, Any]] | None], str]
Unsupported = Callable[[Messages, Sequence[dict[str, Any]] | None], list[str]]


def compare_renderings(cases: Iterable[ChatCase], unsupported: Unsupported, render_hf: HfRender,
                       render_runtime: RuntimeRender,
                       thinking_modes: Sequence[bool] = (False, True)) -> ChatTemplateReport:
    """Render every case in every thinking mode with transformers (``render_hf(messages, thinking,
    tools)``, e.g. a family's ``hf_render`` bound to a tokenizer and the checkpoint's template) and
    with the runtime (``render_runtime(runtime_messages(...), runtime_context(...))``: set the
    context, then ``Llm.apply_chat_template``), and classify each pair by the family's
    ``unsupported(messages, tools)``."""
    report = ChatTemplateReport()
    for case in cases:
        reasons = tuple(unsupported(case.messages, case.tools))
        for thinking in thinking_modes:
            try:
                hf: str | None = render_hf(case.messages, thinking, case.tools)
            except Exception as exc:  # transformers' own error: nothing to compare with
                report.results.append(ChatResult(case.name, thinking, "invalid", None, None,
                                                 (f"transformers: {type(exc).__name__}: {exc}",) + reasons))
                continue
            runtime = render_runtime(runtime_messages(case.messages), runtime_context(thinking, case.tools))
            status = "refused" if reasons else ("equal" if runtime == hf else "differs")
            report.results.append(ChatResult(case.name, thinking, status, hf, runtime, reasons))
    return report


def runtime_renderer(llm: Any) -> RuntimeRender:
    """``render_runtime`` for ``compare_renderings`` from a loaded ``MNN.llm`` model: each call
    merges the context into the model's config (``set_config``), then renders. The context stays
    merged afterwards: verify on an instance of its own, or set the exported context back."""
    def render(messages: list[dict[str, str]], context: dict[str, Any]) -> str:
        llm.set_config({"jinja": {"context": context}})
        text = llm.apply_chat_template(messages)
        assert isinstance(text, str)
        return text
    return render
