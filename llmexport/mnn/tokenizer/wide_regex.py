"""Split regexes with non-ASCII characters, rewritten so that MNN 3.6.1's runtime reads them as HF does.

A pattern with a non-ASCII character and no ``\\p{``/``\\P{`` runs in the runtime on C++'s
``std::wregex`` (ECMAScript grammar, one ``wchar_t`` per code point; unicode.cpp, ``use_wregex``);
one with ``\\p{`` goes to the byte-folding matcher (regex.py), which reads every non-ASCII
character of the pattern as its Unicode category and so cannot be exact. HF runs Oniguruma (Ruby
syntax). The two grammars agree on structure (ordered alternation, greedy and lazy quantifiers,
``(?:...)``, lookahead, leftmost match, backtracking into groups) but not on what a character atom
means: ``\\s``, ``\\w``, ``\\d`` and ``.`` depend on the C++ library and locale, ``\\p{..}`` does not
exist, ``$`` is the end of the text instead of the end of a line.

So ``rewrite_for_wregex`` keeps the structure and replaces every character atom (a literal, an
escape, ``.``, a class ``[...]``) by the class of code points Oniguruma matches with it, listed as
ranges. The set is not derived from a model of Oniguruma: HF's ``tokenizers`` (Oniguruma itself)
applies the atom to every code point (``atom_members``), so the rewrite is exact over every code point
by construction; ranges of code points are compared by value in ``std::wregex``. ``$`` becomes
``LINE_END``. Refused, with the reason: case-insensitive groups (Unicode case folding is not a
property of single code points), ``^``, lookbehind, backreferences, possessive quantifiers, atoms
that are not one code point (``\\R``, ``\\X``), nested classes, and patterns that can match the empty
string (the two engines step past an empty match differently).

Limits: std::regex recurses once per matched character, so very long runs crash the runtime
(``WREGEX_NOTE``, written to the export's notes); a ``wchar_t`` of 16 bits (Windows builds of the
runtime) truncates code points above U+FFFF in both pattern and text; Android, iOS, macOS and
Linux have 32-bit ``wchar_t``.
"""

from __future__ import annotations

import functools
import re
import string
from dataclasses import dataclass

from llmexport.mnn.tokenizer.regex import LINE_END, PatternScanner, UnsupportedRegex

__all__ = ["rewrite_for_wregex", "atom_members", "uses_wregex", "ranges_of", "class_text", "WREGEX_NOTE"]

#: Measured with MNN 3.6.1 on Linux x86-64 (8 MiB main-thread stack): a run of 31,250 characters
#: matched by one repeated class encodes, 33,125 crash the process; the depth scales with the stack.
WREGEX_NOTE = ("Split regex with non-ASCII characters: MNN's runtime matches it with std::regex, which "
               "recurses once per matched character, so a run of about 32,000 characters of one class "
               "crashes the runtime on an 8 MiB stack (about 4,000 on a 1 MiB thread stack)")

_SURROGATES = range(0xD800, 0xE000)
_MAX = 0x10FFFF
_CLASS_SPECIAL = "\\]^-["
_SINGLE_CHAR_ESCAPES = set("sSdDwWhHrntfvae") | {"p", "P", "x", "u"}


def uses_wregex(pattern: str) -> bool:
    """Whether the runtime matches ``pattern`` with std::wregex (unicode.cpp's rule)."""
    return not pattern.isascii() and "\\p{" not in pattern and "\\P{" not in pattern


@functools.lru_cache(maxsize=1)
def _every_code_point() -> str:
    return "".join(chr(cp) for cp in range(_MAX + 1) if cp not in _SURROGATES)


@functools.lru_cache(maxsize=None)
def atom_members(atom: str) -> tuple[tuple[int, int], ...]:
    """The code points HF's Oniguruma matches with the one-character atom ``atom``, as ranges.

    tokenizers' Split (behavior Removed) applies the atom to a text of every code point but the
    surrogates; what it leaves is what the atom does not match."""
    from tokenizers import Regex
    from tokenizers.pre_tokenizers import Split

    text = _every_code_point()
    try:
        kept = Split(Regex(atom), "removed").pre_tokenize_str(text)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for a bad regex
        raise UnsupportedRegex(f"regex atom {atom!r}: HF's Oniguruma rejects it ({exc})") from None
    members = bytearray(b"\1") * (_MAX + 1)
    for piece, (start, end) in kept:
        if end - start != len(piece):
            raise UnsupportedRegex(f"regex atom {atom!r} matches more than one code point at a time")
        for c in piece:
            members[ord(c)] = 0
    for cp in _SURROGATES:  # absent from the text, and from any text the runtime decodes
        members[cp] = 2
    return ranges_of(members)


def ranges_of(members: bytearray) -> tuple[tuple[int, int], ...]:
    """Ranges of the code points marked 1 in ``members``; those marked 2 (never in a text) join
    two ranges they separate, and are otherwise left out."""
    out: list[tuple[int, int]] = []
    start = None
    for cp, flag in enumerate(members):
        if flag == 1:
            if start is None:
                start = cp
            last = cp
        elif flag == 0 and start is not None:
            out.append((start, last))
            start = None
    if start is not None:
        out.append((start, last))
    return tuple(out)


def _char(cp: int, in_class: bool) -> str:
    if cp < 0x20 or cp == 0x7F or cp == 0x5C:  # control characters, and '\' (keeps '\p{' out)
        return f"\\x{cp:02x}"
    c = chr(cp)
    if in_class and c in _CLASS_SPECIAL:
        return "\\" + c
    if not in_class and c in ".^$*+?{}[]|()":
        return "\\" + c
    return c


def class_text(ranges: tuple[tuple[int, int], ...]) -> str:
    """An ECMAScript class (or single character) matching exactly ``ranges``."""
    if not ranges:
        raise UnsupportedRegex("a character atom that matches nothing")
    if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
        return _char(ranges[0][0], in_class=False)
    body = "".join(_char(a, True) if a == b else _char(a, True) + ("" if b == a + 1 else "-") + _char(b, True)
                   for a, b in ranges)
    return f"[{body}]"


@dataclass
class _Piece:
    text: str
    min_len: int  # shortest match, for the empty-match rule


def rewrite_for_wregex(pattern: str) -> str:
    """``pattern`` rewritten for the runtime's std::wregex path, matching what HF's Oniguruma
    matches on every text; raise UnsupportedRegex when no exact rewrite is known."""
    parser = _Parser(pattern)
    piece = parser.alternation()
    if parser.i < len(pattern):
        parser.fail("unbalanced ')'")
    if piece.min_len == 0:
        parser.fail("it can match the empty string")
    if not uses_wregex(piece.text):
        parser.fail("the rewrite has no non-ASCII character, so the runtime would not use std::wregex")
    return piece.text


class _Parser(PatternScanner):
    why_refused = "no exact rewrite for MNN 3.6.1's std::wregex path"

    def alternation(self) -> _Piece:
        branches = [self.branch()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.branch())
        return _Piece("|".join(b.text for b in branches), min(b.min_len for b in branches))

    def branch(self) -> _Piece:
        text, length = "", 0
        while self.peek() not in ("", "|", ")"):
            atom = self.atom()
            low, quantifier = self.quantifier()
            if quantifier and atom.min_len == 0:
                self.fail("a quantified part that can match the empty string")
            text += atom.text + quantifier
            length += atom.min_len * low
        return _Piece(text, length)

    def atom(self) -> _Piece:
        c = self.peek()
        if c == "(":
            return self.group()
        if c == "$":
            self.i += 1
            return _Piece(LINE_END, 0)
        if c == "^":
            self.fail("'^' (Oniguruma: start of a line; ECMAScript has no lookbehind to write it)")
        if c in "*+?{}]":
            self.fail(f"{c!r} where an atom is expected")
        start = self.i
        if c == "[":
            self.skip_class()
        elif c == "\\":
            self.skip_escape()
        else:
            self.i += 1
        source = self.p[start:self.i]
        literal = source[-1] if len(source) == 2 and source[0] == "\\" and not source[1].isalnum() else source
        if len(literal) == 1 and literal != ".":
            return _Piece(class_text(((ord(literal), ord(literal)),)), 1)
        return _Piece(class_text(atom_members(source)), 1)

    def group(self) -> _Piece:
        self.i += 1
        if self.p.startswith("?:", self.i):
            self.i += 2
            opening, lookahead = "(?:", False
        elif self.p.startswith("?!", self.i) or self.p.startswith("?=", self.i):
            opening, lookahead = "(" + self.p[self.i:self.i + 2], True
            self.i += 2
        elif self.peek() == "?":
            self.fail("group syntax other than (?:, (?! and (?= (case-insensitive groups, lookbehind, "
                      "named groups and flags are not read alike)")
        else:
            opening, lookahead = "(?:", False
        inner = self.alternation()
        if self.peek() != ")":
            self.fail("unbalanced '('")
        self.i += 1
        return _Piece(f"{opening}{inner.text})", 0 if lookahead else inner.min_len)

    def quantifier(self) -> tuple[int, str]:
        start = self.i
        repeats = self.repeats()
        if repeats is None:
            return 1, ""
        if self.peek() == "?":
            self.i += 1  # lazy: the same in both engines
        if self.peek() in ("+", "*", "{"):
            self.fail("possessive or stacked quantifiers")
        return repeats[0], self.p[start:self.i]

    def skip_escape(self) -> None:
        start, c = self.i, self.peek(1)
        if not c:
            self.fail("a trailing backslash")
        if c.isalnum() and c not in _SINGLE_CHAR_ESCAPES:
            self.fail(f"escape \\{c} (not a single-character class both engines share)")
        self.i += 2
        if c in "pP" or (c == "x" and self.peek() == "{"):
            end = self.p.find("}", self.i)
            if self.peek() != "{" or end < 0:
                self.fail(f"\\{c} without {{...}}")
            self.i = end + 1
        elif c == "x":
            while self.i < start + 4 and self.peek() in string.hexdigits and self.peek():
                self.i += 1
        elif c == "u":
            if not re.match(r"[0-9A-Fa-f]{4}", self.p[self.i:]):
                self.fail("\\u without four hex digits")
            self.i += 4

    def skip_class(self) -> None:
        self.open_class()
        while (c := self.class_char()) is not None:
            if c == "\\":
                self.skip_escape()
            else:
                self.i += 1
        self.i += 1
