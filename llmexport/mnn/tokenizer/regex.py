"""Which Split regexes MNN 3.6.1's tokenizer reads as HF's `tokenizers` (Oniguruma) does.

MNN's pipeline tokenizer does not use a general regex library for ASCII patterns
(transformers/llm/engine/src/tokenizer/unicode.cpp, ``regex_split`` / ``regex_scanner``): it folds
every non-ASCII character of the text to one byte naming its Unicode category (letter, number,
whitespace, mark, punctuation, symbol, other) and runs a small backtracking matcher over the
folded bytes. That matcher means the same as Oniguruma only for a subset of the syntax, which
``check_split_regex`` accepts and everything else it refuses with the reason:

* atoms: printable ASCII literals (escaped metacharacters too), ``.``, ``\\s \\S \\r \\n \\t \\f \\v``,
  ``\\p{X}`` / ``\\P{X}`` for the one-letter categories L, N, M, P, S, and classes ``[...]`` /
  ``[^...]`` of those (ASCII ranges between plain characters). Refused: ``\\d \\w \\b``, ``\\x..``,
  backreferences, anchors (the matcher reads ``^``/``$`` as literal characters), two-letter
  categories (it reads ``\\p{Lu}`` as ``\\p{L}``), ``\\p{Z}`` (it adds ``\\t\\n``), non-ASCII characters
  (the runtime then switches to ``std::wregex``, which has no ``\\p{..}``), class intersections;
* greedy quantifiers ``? * + {n} {n,} {n,m}`` (it ignores a lazy ``?``; possessive ``+`` is refused);
* groups ``(...)``, ``(?:...)``, ``(?i:...)`` only as the last atom of their branch with at most one
  mandatory repetition: the matcher keeps the first way a group matches and never backtracks into
  it, which is what a backtracking engine does too when nothing after the group can fail;
  negative lookahead ``(?!...)`` of group-free branches anywhere. Other ``(?`` forms are refused (the
  runtime silently drops such a branch).

Even then some characters of the *text* are classified differently; ``RegexCheck.unsafe_chars``
lists them for a pattern: the measured per-class differences of unicode.py (control
characters U+0001-U+0003 and U+0005-U+0007, U+0085/U+2028/U+2029 for ``\\s``, characters added
after Unicode 15.0), and for ``(?i:...)`` the characters whose Unicode case folding contains one of
its letters (Oniguruma folds over Unicode: ``'ſ`` matches ``(?i:'s)``; MNN only over ASCII).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import NoReturn

from llmexport.mnn.tokenizer.unicode import CLASS_DIFFERENCE_RANGES

__all__ = ["RegexCheck", "UnsupportedRegex", "check_split_regex", "escape_literal", "class_differences",
           "LINE_END", "end_of_line_as_lookahead", "PatternScanner"]

#: Oniguruma's (Ruby syntax) ``$``: before a line feed or at the end of the text, not only at the end.
LINE_END = "(?![^\\n])"

_PROPERTIES = ("L", "N", "M", "P", "S")
_PLAIN_ESCAPES = "rntfv"
_QUANTIFIER = re.compile(r"\{(\d+)(,(\d*))?\}")


class UnsupportedRegex(ValueError):
    pass


@dataclass
class RegexCheck:
    """What an accepted pattern uses: character classes and case-insensitive ASCII letters."""

    classes: set[str] = field(default_factory=set)
    folded_letters: set[str] = field(default_factory=set)
    folded_runs: set[str] = field(default_factory=set)  # consecutive case-insensitive literal letters
    loose_folding: bool = False  # a case-insensitive letter is repeated or in a class

    def unsafe_chars(self) -> frozenset[str]:
        """Characters on which the runtime's split may differ from HF's for this pattern."""
        out: set[str] = set()
        for name in self.classes:
            out |= class_differences(name)
        if self.folded_letters:
            out |= _case_fold_partners("".join(sorted(self.folded_letters)),
                                       None if self.loose_folding else tuple(sorted(self.folded_runs)))
        return frozenset(out)


def class_differences(name: str) -> set[str]:
    """Text characters one class (``s``, ``L``, ``N``, ``M``, ``P``, ``S``, ``.``) of the runtime's
    matcher classifies differently from Oniguruma (measured, unicode.py)."""
    return {chr(cp) for start, end in CLASS_DIFFERENCE_RANGES[name] for cp in range(start, end + 1)}


@functools.lru_cache(maxsize=None)
def _case_fold_partners(letters: str, runs: tuple[str, ...] | None) -> frozenset[str]:
    """Non-ASCII characters Oniguruma may match case-insensitively where MNN does not: those whose
    Unicode case folding is one of ``letters`` (ſ for s, K for k), or a sequence of them that
    occurs in one of ``runs`` (ß for "ss"; ``runs`` None: any sequence of the letters)."""
    out = set()
    for cp in range(0x80, 0x110000):
        folded = chr(cp).casefold()
        if 0xD800 <= cp < 0xE000 or not folded.isascii() or not set(folded) <= set(letters):
            continue
        if len(folded) == 1 or runs is None or any(folded in run for run in runs):
            out.add(chr(cp))
    return frozenset(out)


def escape_literal(text: str) -> str:
    """A literal String pattern as a pattern MNN's matcher reads literally."""
    return "".join("\\" + c if c in ".^$*+?{}[]\\|()" else c for c in text)


def end_of_line_as_lookahead(pattern: str) -> str:
    """``pattern`` with each ``$`` outside a class written as ``LINE_END``, which both runtime
    matchers read as HF does (the byte matcher reads ``$`` as a literal dollar sign)."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern.startswith("[^]", i) or pattern.startswith("[]", i):
                raise UnsupportedRegex(f"regex {pattern!r}: ']' first in a class")
        elif c == "$":
            c = LINE_END
        out.append(c)
        i += 1
    return "".join(out)


def check_split_regex(pattern: str) -> RegexCheck:
    """Accept ``pattern`` if MNN 3.6.1 reads it as Oniguruma does; raise UnsupportedRegex otherwise."""
    if not pattern:
        raise UnsupportedRegex("empty regex")
    parser = _Parser(pattern)
    parser.alternation(icase=False, groups=True)
    if parser.i < len(pattern):
        parser.fail("unbalanced ')'")
    return parser.check


class PatternScanner:
    """A position in a pattern and the checks both parsers make (this module's, and
    wide_regex.py's): ``why_refused`` ends every refusal."""

    why_refused = "MNN 3.6.1's matcher reads it differently from HF"

    def __init__(self, pattern: str):
        self.p, self.i = pattern, 0

    def fail(self, why: str) -> NoReturn:
        raise UnsupportedRegex(f"regex {self.p!r}: {why} (offset {self.i}); {self.why_refused}")

    def peek(self, ahead: int = 0) -> str:
        j = self.i + ahead
        return self.p[j] if j < len(self.p) else ""

    def open_class(self) -> None:
        """Past a class's ``[`` and ``^``; a ``]`` first is refused (Oniguruma warns and reads it literally)."""
        self.i += 1
        if self.peek() == "^":
            self.i += 1
        if self.peek() == "]":
            self.fail("']' first in a class")

    def repeats(self) -> tuple[int, int | None] | None:
        """A quantifier's (min, max) read past (max None: unbounded), or None where there is none."""
        c = self.peek()
        if c in ("+", "*", "?"):
            self.i += 1
            return {"+": (1, None), "*": (0, None), "?": (0, 1)}[c]
        if c != "{":
            return None
        m = _QUANTIFIER.match(self.p, self.i)
        if not m:
            self.fail("'{' that is not a {n}, {n,} or {n,m} quantifier")
        low = int(m[1])
        high = low if m[2] is None else (int(m[3]) if m[3] else None)
        if high is not None and high < low:
            self.fail("quantifier {n,m} with m < n")
        self.i = m.end()
        return low, high

    def class_char(self) -> str | None:
        """The next character inside a class, None at its ``]``; nested classes and intersections refused."""
        c = self.peek()
        if not c:
            self.fail("unterminated class")
        if c == "[" or (c == "&" and self.peek(1) == "&"):
            self.fail("nested class, POSIX bracket or intersection")
        return None if c == "]" else c


class _Parser(PatternScanner):
    def __init__(self, pattern: str):
        super().__init__(pattern)
        self.check = RegexCheck()

    def alternation(self, icase: bool, groups: bool) -> None:
        self.branch(icase, groups)
        while self.peek() == "|":
            self.i += 1
            self.branch(icase, groups)

    def branch(self, icase: bool, groups: bool) -> None:
        run = ""
        while self.peek() not in ("", "|", ")"):
            start = self.i
            kind = self.atom(icase, groups)
            repeats = self.quantifier()
            letter = icase and self.i - start >= 1 and self.p[start].isalpha() and self.p[start].isascii()
            if letter and repeats is not None:
                self.check.loose_folding = True
            run = run + self.p[start].lower() if letter and repeats is None else ""
            if run:
                self.check.folded_runs.add(run)
            if kind == "lookahead" and repeats is not None:
                self.fail("quantified lookahead")
            if kind == "group":
                if repeats is not None and repeats[0] > 1:
                    self.fail("a group repeated more than once at minimum (the matcher does not backtrack into groups)")
                if self.peek() not in ("", "|", ")"):
                    self.fail("a group followed by more pattern (the matcher does not backtrack into groups)")

    def atom(self, icase: bool, groups: bool) -> str:
        c = self.peek()
        if c == "(":
            if not groups:
                self.fail("a group inside a lookahead")
            return self.group(icase)
        if c == "[":
            self.char_class(icase)
        elif c == "\\":
            self.escape(icase)
        elif c == ".":
            self.i += 1
            self.check.classes.add(".")
        elif c in "^$":
            self.fail("anchor")
        elif c in "*+?{}]":
            self.fail(f"{c!r} where an atom is expected")
        else:
            self.literal(c, icase)
            self.i += 1
        return "chars"

    def group(self, icase: bool) -> str:
        self.i += 1
        kind = "group"
        if self.p.startswith("?:", self.i):
            self.i += 2
        elif self.p.startswith("?i:", self.i):
            self.i += 3
            icase = True
        elif self.p.startswith("?!", self.i):
            self.i += 2
            kind = "lookahead"
        elif self.peek() == "?":
            self.fail("group syntax other than (?:, (?i: and (?!")
        self.alternation(icase, groups=kind == "group")
        if self.peek() != ")":
            self.fail("unbalanced '('")
        self.i += 1
        return kind

    def quantifier(self) -> tuple[int, int | None] | None:
        repeats = self.repeats()
        if repeats is None:
            return None
        if self.peek() in ("?", "+"):
            self.fail("lazy or possessive quantifier (the matcher is always greedy)")
        if self.peek() in ("*", "{"):
            self.fail("stacked quantifiers")
        return repeats

    def escape(self, icase: bool) -> None:
        c = self.peek(1)
        self.i += 2
        if c in ("s", "S"):
            self.check.classes.add("s")
        elif c in ("p", "P"):
            m = re.match(r"\{(\w+)\}", self.p[self.i:])
            if not m or m[1] not in _PROPERTIES:
                self.fail(f"\\{c}{{..}} other than {', '.join(_PROPERTIES)} (the matcher reads only the first letter)")
            self.i += m.end()
            self.check.classes.add(m[1])
        elif c and c in _PLAIN_ESCAPES:
            pass
        elif not c or c.isalnum() or not 0x20 < ord(c) < 0x7F:
            self.fail(f"escape \\{c}")
        else:
            self.literal(c, icase)

    def char_class(self, icase: bool) -> None:
        self.check.loose_folding |= icase
        self.open_class()
        while (c := self.class_char()) is not None:
            if c == "\\":
                self.escape(icase)
                if self.peek() == "-" and self.peek(1) not in ("]", ""):
                    self.fail("range starting at an escape")
                continue
            self.literal(c, icase)
            self.i += 1
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                end = self.peek(1)
                if end == "\\" or not 0x20 <= ord(end) < 0x7F or not 0x20 <= ord(c) or end < c:
                    self.fail(f"range {c!r}-{end!r} (only increasing ranges of printable ASCII)")
                for ch in map(chr, range(ord(c), ord(end) + 1)):
                    self.literal(ch, icase)
                self.i += 2
        self.i += 1

    def literal(self, c: str, icase: bool) -> None:
        if not 0x08 <= ord(c) < 0x80:
            self.fail(f"character {c!r} (non-ASCII patterns run on std::wregex; U+0000-U+0007 are fold markers)")
        if icase and c.isalpha():
            self.check.folded_letters.add(c.lower())
