"""HF's ``ignore_merges`` (whole-word lookup before BPE) against MNN 3.6.1's runtime, which has none.

With ``ignore_merges=true`` HF's BPE first looks the whole pre-tokenized word up in the vocabulary
and runs the merges only when it is missing. No tokenizer MNN 3.6.1 loads does that for a BPE
vocabulary (transformers/llm/engine/src/tokenizer/tokenizer.cpp at tag 3.6.1): the pipeline's
``BPEModel::tokenize`` starts from the word's byte characters (or characters and ``<0xNN>``
pieces) and applies merges by rank until none applies, with no lookup of the word; its
``WordPieceModel`` and ``UnigramModel`` and the legacy ``Sentencepiece`` (score-ordered pair
merges), ``Tiktoken`` (greedy longest match in a trie), ``BertTokenizer`` (WordPiece) and
``HuggingfaceTokenizer`` (a fixed ASCII regex, then rank-ordered merges) are other algorithms. A
merge added to reach a whole-word token applies to its two parts wherever they end adjacent,
also inside longer words where HF keeps them apart, so extra merges are no exact substitute
either. Words that only the lookup reaches (``unreachable_words``) are therefore refused, unless
the user opts in (``approximate_ignore_merges``); the export then records the difference measured
here: the affected words and the share of random strings made of the vocabulary's own pieces
that HF encodes differently without the lookup (what the runtime computes).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

__all__ = ["IgnoreMergesDifference", "measure_ignore_merges", "piece_texts", "random_piece_strings",
           "APPROXIMATE_FLAG"]

#: The command-line flag that accepts the difference.
APPROXIMATE_FLAG = "--approximate_ignore_merges"
_EXTRA = (" ", "  ", "\n", "\t", "\r\n", "'s", "123")


@dataclass(frozen=True)
class IgnoreMergesDifference:
    """``words``: vocabulary words only the whole-word lookup reaches (all of them, sorted);
    ``random_strings`` / ``random_mismatches``: strings measured and how many encode differently."""

    words: tuple[str, ...]
    random_strings: int
    random_mismatches: int

    @property
    def mismatch_rate(self) -> float:
        return self.random_mismatches / self.random_strings if self.random_strings else 0.0

    def summary(self) -> str:
        return (f"ignore_merges approximated: {len(self.words)} vocabulary word(s) such as {list(self.words[:3])} "
                f"encode as merges give them, not as one token; {self.random_mismatches}/{self.random_strings} "
                f"random strings of the vocabulary's pieces ({self.mismatch_rate:.2%}) encode differently from HF")

    def to_json(self) -> dict[str, Any]:
        return {"affected_words": len(self.words), "examples": list(self.words[:20]),
                "random_strings": self.random_strings, "random_mismatches": self.random_mismatches,
                "mismatch_rate": round(self.mismatch_rate, 6)}


def piece_texts(tj: dict) -> list[str]:
    """The model vocabulary's pieces as text (byte pieces and pieces that are not whole
    characters left out)."""
    from llmexport.mnn.tokenizer.byte_level import byte_level_chars

    byte_level = not (tj.get("model") or {}).get("byte_fallback")
    char_bytes = {c: b for b, c in enumerate(byte_level_chars())}
    out = []
    for piece in (tj.get("model") or {}).get("vocab", {}):
        if byte_level:
            try:
                out.append(bytes(char_bytes[c] for c in piece).decode("utf-8"))
            except (KeyError, UnicodeDecodeError):
                continue
        elif not piece.startswith("<0x"):
            out.append(piece.replace("\u2581", " "))
    return out


def random_piece_strings(tj: dict, count: int, seed: int = 0) -> list[str]:
    """``count`` strings of 1-12 random vocabulary pieces, some whitespace and digits, and now and
    then an added token."""
    rng = random.Random(seed)
    pieces = piece_texts(tj)
    added = [t["content"] for t in tj.get("added_tokens", [])]
    out = []
    for _ in range(count):
        parts = [rng.choice(pieces) if rng.random() < 0.85 else rng.choice(_EXTRA) for _ in range(rng.randint(1, 12))]
        if added and rng.random() < 0.2:
            parts.insert(rng.randrange(len(parts) + 1), rng.choice(added))
        out.append("".join(parts))
    return out


def measure_ignore_merges(tj: dict, words: list[str], count: int = 2000, seed: int = 0) -> IgnoreMergesDifference:
    """HF's ids against HF's ids without the whole-word lookup on ``count`` random strings."""
    from tokenizers import Tokenizer

    exact = Tokenizer.from_str(json.dumps(tj))
    spec = json.loads(json.dumps(tj))
    spec["model"]["ignore_merges"] = False
    merged = Tokenizer.from_str(json.dumps(spec))
    texts = random_piece_strings(tj, count, seed)
    want = exact.encode_batch(texts, add_special_tokens=False)
    got = merged.encode_batch(texts, add_special_tokens=False)
    differ = sum(a.ids != b.ids for a, b in zip(want, got))
    return IgnoreMergesDifference(tuple(sorted(words)), len(texts), differ)
