"""Split regexes with non-ASCII characters (mnn/tokenizer/wide_regex.py): rewritten for the runtime's
std::wregex path and proven against HF's Oniguruma over every code point, in Python and in MNN
3.6.1's runtime; ``$`` written as a lookahead for the runtime's byte matcher."""

from __future__ import annotations

import json
import os
import random
import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from real_vocab_tokenizers import DEEPSEEK_CODER_SPLITS, DEEPSEEK_LLM_SPLITS
from test_tokenizer_regex import Probe, byte_spec, removing
from tokenizers import Regex
from tokenizers.pre_tokenizers import Split

from llmexport.mnn.tokenizer import pipeline as tokenizer_pipeline
from llmexport.mnn.tokenizer.regex import LINE_END, UnsupportedRegex, end_of_line_as_lookahead
from llmexport.mnn.tokenizer.wide_regex import WREGEX_NOTE, atom_members, class_text, rewrite_for_wregex, uses_wregex
from llmexport.mnn.tokenizer.writer import convert_tokenizer

EVERY_CODE_POINT = "".join(chr(cp) for cp in range(0x110000) if not 0xD800 <= cp < 0xE000)
WIDE_DEEPSEEK = sorted({p for p in DEEPSEEK_LLM_SPLITS + DEEPSEEK_CODER_SPLITS if not p.isascii()})
DEEPSEEK_CLASSES = [re.match(r"(\\s\?)?(\[.*\])\+$", p, re.S)[2] for p in WIDE_DEEPSEEK]


def hf_pieces(pattern: str, text: str, behavior: str = "isolated") -> list[str]:
    return [piece for piece, _ in Split(Regex(pattern), behavior).pre_tokenize_str(text)]


def re_pieces(pattern: str, text: str) -> list[str]:
    """HF's Isolated split, computed with Python's backtracking ``re`` reading ``pattern``."""
    out, last = [], 0
    for m in re.finditer(pattern, text):
        out += [text[last:m.start()], m[0]]
        last = m.end()
    return [piece for piece in out + [text[last:]] if piece]


ATOMS = [r"\s", r"\S", r"\p{L}", r"\P{N}", r"\p{P}", r".", r"[^\r\n\p{L}\p{P}\p{S}]", r"\w", r"\d", r"\h",
         r"\x{1F600}", r"\u00e9", r"[\]\-\\^a-c]", "[^\u4e00-\u9fa5]", *DEEPSEEK_CLASSES]


@pytest.mark.parametrize("atom", ATOMS)
def test_rewritten_atom_matches_what_oniguruma_matches_on_every_code_point(atom):
    """The class written for the atom, read with code-point ranges (as std::wregex reads them),
    removes from a text of every code point exactly what Oniguruma's atom removes."""
    written = class_text(atom_members(atom))
    assert "\\p{" not in written and "\\P{" not in written
    assert re.sub(written, "", EVERY_CODE_POINT) == "".join(hf_pieces(atom, EVERY_CODE_POINT, "removed"))


def test_deepseek_patterns_are_rewritten_for_wregex():
    for pattern in WIDE_DEEPSEEK:
        rewritten = rewrite_for_wregex(pattern)
        assert uses_wregex(rewritten) and "\\s" not in rewritten
        sample = "Hello  wörld,\u3000“quoted”！ 中文한국어 x\u2028y\n\t12"
        assert re_pieces(rewritten, sample) == hf_pieces(pattern, sample)


_ATOM_POOL = ["a", "é", "中", " ", "\\.", "-", "[a-zé]", "[^\\s中]", "[\u4e00-\u9fa5]", "\\s", "\\S", "\\p{L}",
              "\\p{N}", ".", "[!-/\u3000-\u3002]", "[\u0800-\u4e00\uac00-\ud7ff]"]
_QUANTIFIERS = ["", "", "?", "*", "+", "{1,3}", "{2}", "+?", "??", "*?"]
_TEXT_POOL = "ab é中一가 \n\t\r1٣-.!\u3000。\u2028\x85Z"


@st.composite
def wide_patterns(draw, depth: int = 2) -> str:
    branches = []
    for _ in range(draw(st.integers(1, 3))):
        parts = []
        for _ in range(draw(st.integers(1, 3))):
            kind = draw(st.sampled_from(["atom"] * 6 + (["group", "lookahead"] if depth else []) + ["end"]))
            if kind == "atom":
                parts.append(draw(st.sampled_from(_ATOM_POOL)) + draw(st.sampled_from(_QUANTIFIERS)))
            elif kind == "group":
                parts.append(f"(?:{draw(wide_patterns(depth - 1))})" + draw(st.sampled_from(_QUANTIFIERS)))
            elif kind == "lookahead":
                parts.append(f"(?{draw(st.sampled_from('!='))}{draw(st.sampled_from(_ATOM_POOL))})")
            else:
                parts.append("$")
        branches.append("".join(parts))
    return "|".join(branches)


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 300)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(pattern=wide_patterns(), texts=st.lists(st.text(_TEXT_POOL, max_size=12), min_size=1, max_size=8))
def test_rewrite_splits_like_oniguruma(pattern, texts):
    """Random patterns of classes, literals, groups, lookaheads, ``$`` and greedy or lazy
    quantifiers: the rewrite, read by a backtracking engine with code-point classes (``re``, as
    std::wregex), splits every text as Oniguruma splits it with the original."""
    assume(not pattern.isascii())
    try:
        rewritten = rewrite_for_wregex(pattern)
    except UnsupportedRegex as exc:  # the only refusals this grammar can meet
        assert "empty string" in str(exc) or "quantified part that can match the empty string" in str(exc)
        return
    for text in texts:
        assert re_pieces(rewritten, text) == hf_pieces(pattern, text), (pattern, rewritten, text)


REFUSED = {"^é": "'^'", "(?i:é)": "group syntax", "é*": "empty string", "(?<=a)é": "group syntax",
           "é\\1": "escape \\1", "é++": "possessive", "[[a]é]": "nested class", "é|": "empty string",
           "\\Ré": "escape \\R", "(?:é?)+": "quantified part", "[é": "unterminated", "(é": "unbalanced",
           "é)": "unbalanced", "é{2,1}": "m < n", "\\p{Greek}+é": None}


@pytest.mark.parametrize("pattern", sorted(REFUSED))
def test_refusals_name_the_reason(pattern):
    if REFUSED[pattern] is None:  # Oniguruma knows the script property: accepted, and exact
        rewritten = rewrite_for_wregex(pattern)
        assert re_pieces(rewritten, "αβγé abcé") == hf_pieces(pattern, "αβγé abcé")
        return
    with pytest.raises(UnsupportedRegex, match=re.escape(REFUSED[pattern])) as err:
        rewrite_for_wregex(pattern)
    assert "\n" not in str(err.value)


def test_dollar_is_the_end_of_a_line_as_in_oniguruma():
    assert end_of_line_as_lookahead(r"\s+$|[$]\$") == r"\s+" + LINE_END + r"|[$]\$"
    for text in ["a  \nb  \r\nc \u2028d   ", "x\n\n", "  ", "a$ b"]:
        assert re_pieces(end_of_line_as_lookahead(r"\s+$"), text) == hf_pieces(r"\s+$", text)


def test_wide_split_notes_the_runtime_recursion_limit(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps(byte_spec([removing("[一-龥]+")])), encoding="utf-8")
    assert WREGEX_NOTE in convert_tokenizer(tmp_path).notes


# --- the runtime ----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("pattern", WIDE_DEEPSEEK + ["\\p{N}|[^\\p{L}\u4e00-\u9fa5]+"])
def test_runtime_removes_what_hf_removes_on_every_code_point(tmp_path, pattern):
    probe = Probe(tmp_path, byte_spec([removing(pattern)]))
    try:
        assert probe.differing_code_points() == set()
    finally:
        probe.mnn.close()


RUNTIME_PATTERNS = ["(?:é|中+)+x?", "[a-zé]+?(?=\\s)", "\\S+$", "(?!中)\\p{L}+|\\s", "é\\.[^\\s中]{1,3}|-+",
                    "\\s+$", "[!-/\u3000-\u3002]+|\\p{N}"]


@pytest.mark.slow
@pytest.mark.parametrize("pattern", RUNTIME_PATTERNS)
def test_runtime_splits_structured_patterns_like_hf(tmp_path, pattern):
    texts = _random_texts(300)
    probe = Probe(tmp_path, byte_spec([removing(pattern)]))
    try:
        assert probe.differences(texts) == []
    finally:
        probe.mnn.close()


def _random_texts(n: int) -> list[str]:
    """Texts of the pool's characters, less U+2028 and U+0085 (the byte matcher's ``\\s`` differs on them)."""
    pool = _TEXT_POOL.replace("\u2028", "").replace("\x85", "")
    rng = random.Random(7)
    return ["".join(rng.choice(pool) for _ in range(rng.randrange(1, 17))) for _ in range(n)]


#: Pattern -> texts on which std::wregex reads the pattern *as HF wrote it* differently from
#: Oniguruma (measured): ``$`` only at the end, C-locale ``\s``/``\w``/``\d``, ``.`` also stops at
#: CR and U+2028. The rewrite agrees on all of them.
READ_DIFFERENTLY_UNREWRITTEN = {
    "(?:é|x)+$": ["x\ny", "éé\n"], "é\\s": ["é\u3000", "é\u00a0", "é\u2028", "é\x85"], "é.": ["é\r", "é\u2028"],
    "é\\w": ["éé", "é中", "é٣"], "é\\d": ["é٣"], DEEPSEEK_LLM_SPLITS[1]: ["x\u3000Hello", "x\u00a0Hello"],
}


@pytest.mark.slow
@pytest.mark.parametrize("pattern", sorted(READ_DIFFERENTLY_UNREWRITTEN))
def test_the_rewrite_is_what_makes_the_runtime_agree(tmp_path, monkeypatch, pattern):
    texts = READ_DIFFERENTLY_UNREWRITTEN[pattern] + ["é a", "x"]
    rewritten = Probe(tmp_path / "rewritten", byte_spec([removing(pattern)]))
    monkeypatch.setattr(tokenizer_pipeline, "rewrite_for_wregex", lambda p: p)
    original = Probe(tmp_path / "original", byte_spec([removing(pattern)]))
    try:
        assert rewritten.differences(texts) == []
        assert original.differences(texts) == READ_DIFFERENTLY_UNREWRITTEN[pattern]
    finally:
        rewritten.mnn.close()
        original.mnn.close()
