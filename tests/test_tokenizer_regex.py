"""Split regexes: which ones MNN 3.6.1's matcher reads as HF does, measured against the runtime.

Probes are byte-level tokenizers without merges whose Split *removes* what the pattern matches,
so the ids the runtime returns show exactly which characters matched.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from llmexport.mnn.tokenizer import pipeline as tokenizer_pipeline
from llmexport.mnn.tokenizer.byte_level import byte_level_chars
from llmexport.mnn.tokenizer.pipeline import GPT2_PATTERN
from llmexport.mnn.tokenizer.regex import RegexCheck, UnsupportedRegex, check_split_regex, class_differences
from llmexport.mnn.tokenizer.writer import write_mnn_tokenizer
from llmexport.tiny.byte_level_tokenizer import LLAMA3_PATTERN, QWEN_PATTERN

from mnn_tokenizer_server import MnnTokenizer

ALL_CODE_POINTS = [cp for cp in range(1, 0x110000) if not 0xD800 <= cp < 0xE000]
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}


def byte_spec(pre_tokenizers: list[dict], merges: list[list[str]] = ()) -> dict:
    """tokenizer.json of a byte-level BPE (256 byte characters, ``merges``) behind ``pre_tokenizers``."""
    vocab = {c: i for i, c in enumerate(byte_level_chars())}
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [*pre_tokenizers, _BYTE_LEVEL]},
            "post_processor": None, "decoder": dict(_BYTE_LEVEL),
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": [list(m) for m in merges]}}


def removing(pattern: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Removed", "invert": False}


class Probe:
    """One tokenizer.json written for MNN and loaded in HF; ``differences(texts)`` -> mismatching texts."""

    def __init__(self, folder: Path, spec: dict):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
        write_mnn_tokenizer(folder, folder / "tokenizer.mtok")
        self.hf = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.mnn = MnnTokenizer(folder / "runtime", "../tokenizer.mtok", self.hf.get_vocab_size())

    def hf_ids(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def differences(self, texts: list[str]) -> list[str]:
        return [t for t, got in zip(texts, self.mnn.encode(texts)) if got != self.hf_ids(t)]

    def differing_code_points(self) -> set[int]:
        """Every code point whose removal differs, found by bisecting chunks that disagree."""
        found: set[int] = set()

        def bisect(chunk: list[int]) -> None:
            if not self.differences(["".join(map(chr, chunk))]):
                return
            if len(chunk) == 1:
                found.add(chunk[0])
                return
            bisect(chunk[:len(chunk) // 2])
            bisect(chunk[len(chunk) // 2:])

        for start in range(0, len(ALL_CODE_POINTS), 8192):
            bisect(ALL_CODE_POINTS[start:start + 8192])
        return found


# --- what the validator accepts and refuses ------------------------------------------------------

@pytest.mark.parametrize("pattern", [GPT2_PATTERN, LLAMA3_PATTERN, QWEN_PATTERN,
                                     r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?"
                                     r"[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*",
                                     r"\s+(?!\S)|\s+", r"(?:ab|a)+", r".", r"\P{N}{2,}", r"x{3}|y{1,}"])
def test_accepts_patterns_it_reads_like_hf(pattern):
    assert isinstance(check_split_regex(pattern), RegexCheck)


REFUSED = {
    r"\d+": "escape \\d", r"\w+": "escape \\w", r"\bfoo": "escape \\b", r"\x41": "escape \\x", r"a\1": "escape \\1",
    r"^a": "anchor", r"a$": "anchor", r"\p{Lu}": "other than", r"\p{Z}": "other than",
    "[一-龥]+": "non-ASCII", r"(?:a|ab)c": "followed by more", r"(?:ab){2,}": "more than once",
    r"a+?": "lazy", r"a++": "possessive", r"(?=a)b": "group syntax", r"(?<=a)b": "group syntax",
    r"(?x:a)": "group syntax", r"[a&&b]": "intersection", r"[[:alpha:]]": "nested class", r"(a": "unbalanced",
    r"a)": "unbalanced", r"[\!-/]": "range starting at an escape", r"[z-a]": "range", r"a{,3}": "quantifier",
    r"(?!(?:a))": "inside a lookahead", r"(?!a)+": "quantified lookahead", r"[]a]": "first in a class", "": "empty",
}


@pytest.mark.parametrize("pattern", sorted(REFUSED))
def test_refuses_patterns_it_reads_differently(pattern):
    with pytest.raises(UnsupportedRegex, match=re.escape(REFUSED[pattern])):
        check_split_regex(pattern)


def test_refusal_names_the_file(tmp_path):
    spec = byte_spec([removing(r"\d+")])
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(ValueError, match=r"tokenizer\.json: unsupported Split pre-tokenizer: regex .*escape \\d"):
        write_mnn_tokenizer(tmp_path, tmp_path / "out.mtok")


# Refused patterns, written anyway (validator bypassed): the runtime really reads them differently.
READ_DIFFERENTLY = [
    (r"\d", "x²y"),  # MNN: any number; Oniguruma: decimal digits
    (r"\p{Lu}", "aB"),  # MNN: first letter only, i.e. \p{L}
    (r"(?:a|ab)c", "abc"),  # MNN does not backtrack into the group
    (r"<.+?>", "<a>x<b>"),  # MNN is greedy
    (r"^a", "ba^a"),  # MNN: literal '^'
    (r"\bx", "x ax"),  # MNN drops the branch, then falls back to GPT-2's pattern
]


@pytest.fixture
def bypass_validator(monkeypatch):
    monkeypatch.setattr(tokenizer_pipeline, "check_split_regex", lambda pattern: RegexCheck())


@pytest.mark.parametrize("pattern,text", READ_DIFFERENTLY)
def test_refused_patterns_are_read_differently(tmp_path, bypass_validator, pattern, text):
    probe = Probe(tmp_path, byte_spec([removing(pattern)]))
    try:
        assert probe.differences([text]) == [text]
    finally:
        probe.mnn.close()


def test_merged_with_previous_refused_because_adjacent_matches_merge(tmp_path, monkeypatch):
    split = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False}
    spec = byte_spec([split], merges=[["Ġ", "Ġ"]])
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(ValueError, match="MergedWithPrevious"):
        write_mnn_tokenizer(tmp_path, tmp_path / "out.mtok")
    monkeypatch.setattr(tokenizer_pipeline, "_removed_literals", lambda node: {" "})
    probe = Probe(tmp_path / "bypassed", spec)
    try:  # HF: "a ", " ", "b"; the runtime: "a  ", "b" (one merged double space)
        assert probe.differences(["a  b", "a b"]) == ["a  b"]
    finally:
        probe.mnn.close()


# --- every code point, per character class ------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name,pattern", [("s", r"\s"), ("L", r"\p{L}"), ("N", r"\p{N}"), ("M", r"\p{M}"),
                                          ("P", r"\p{P}"), ("S", r"\p{S}"), (".", r".")])
def test_class_differences_are_the_measured_ones(tmp_path, name, pattern):
    probe = Probe(tmp_path, byte_spec([removing(pattern)]))
    try:
        measured = probe.differing_code_points()
    finally:
        probe.mnn.close()
    assert {chr(cp) for cp in measured} == class_differences(name)


@pytest.mark.slow
def test_case_insensitive_differences_are_within_the_listed_partners(tmp_path):
    probe = Probe(tmp_path, byte_spec([removing(r"(?i:[a-z])")]))
    try:
        measured = {chr(cp) for cp in probe.differing_code_points()}
    finally:
        probe.mnn.close()
    assert measured == {"\u017f", "\u212a"}  # ſ (s) and the Kelvin sign (k)
    assert measured <= check_split_regex(r"(?i:[a-z])").unsafe_chars()


def test_composed_classes_add_up(tmp_path):
    """A negated class of several classes differs exactly on the union of their differences."""
    probe = Probe(tmp_path, byte_spec([removing(r"[^\s\p{L}\p{N}]")]))
    try:
        union = class_differences("s") | class_differences("L") | class_differences("N")
        sample = sorted(union)[::7] + ["a", "1", " ", "!", "\u00e9", "\u4e2d", "\u0301"]
        assert set(probe.differences(sample)) == set(sample) & union
    finally:
        probe.mnn.close()


@pytest.mark.parametrize("individual", [True, False])
def test_digits_pre_tokenizer_is_written_as_a_number_split(tmp_path, individual):
    """HF's Digits pre-tokenizer splits on every Unicode number (the runtime's own Digits: ASCII
    digits only, and nothing without individual_digits); written as a ``\\p{N}`` Split it agrees."""
    digits = {"type": "Digits", "individual_digits": individual}
    pairs = [[a, b] for a in "0123456789ab" for b in "0123456789ab"]
    probe = Probe(tmp_path, byte_spec([digits], pairs))
    try:
        texts = ["a12345b", "x 2024-05-06 y", "v1.2.3", "٣٤ and ²³ and Ⅻ", "12ab34", "1", "", "ab 99 cd"]
        assert probe.differences(texts) == []
        assert len(probe.hf_ids("12345")) == (5 if individual else 3)
    finally:
        probe.mnn.close()
