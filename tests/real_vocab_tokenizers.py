"""Test data: HF ``tokenizer.json`` folders rebuilt from llama.cpp's real vocabulary files.

Each ``ggml-vocab-X.gguf`` (tests/real_vocab.py) holds the tokens, token types, scores, merges and
the name of the pre-tokenizer of a HF tokenizer. ``rebuild(name)`` writes a tokenizer folder from
it: the vocabulary and merges as stored (SentencePiece vocabularies store no merges: they are
derived from the scores as ``transformers``' SentencePiece converter derives them), the added
tokens from the token types (3 control = special, 4 user-defined = added, not special), and the
normalizer / pre-tokenizer / decoder of the HF tokenizer that the pre-tokenizer name stands for
(written from the regexes llama.cpp's ``llama-vocab.cpp`` quotes from those tokenizer.json files).
Flags a GGUF file does not keep (``lstrip``/``rstrip``, ``ignore_merges``) are set as the real
tokenizer.json files have them (``SPECS``). tests/test_tokenizer_real_vocab.py proves each rebuild
against the ``.inp``/``.out`` ids HF produced.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmexport.tiny.byte_level_tokenizer import LLAMA3_PATTERN, QWEN_PATTERN

from real_vocab import real_vocab

SPACE = "\u2581"
QWEN35_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# Quoted from llama.cpp's llama-vocab.cpp, escaped (the literal characters include canonical singletons
# such as U+1FD3 that an NFC-normalizing editor would silently replace).
DEEPSEEK_LLM_SPLITS = (
    "[\r\n]",
    "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-"
    "\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57"
    "\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-"
    "\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-"
    "\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184"
    "\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-"
    "\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-"
    "\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    "\\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    "\\p{N}+",
)
DEEPSEEK_CODER_SPLITS = (
    "[\r\n]",
    "\\s?\\p{L}+",
    "\\s?\\p{P}+",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    "\\p{N}",
)

#: Phi-3's added tokens with ``rstrip`` (microsoft/Phi-3-mini-4k-instruct tokenizer.json).
PHI3_RSTRIP = ("</s>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
               "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>")


def _split(pattern: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


def _byte_level(use_regex: bool) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def _splits_then_bytes(*patterns: str) -> dict:
    return {"type": "Sequence", "pretokenizers": [*map(_split, patterns), _byte_level(False)]}


def _digits(individual: bool) -> dict:
    return {"type": "Digits", "individual_digits": individual}


_NFC = {"type": "NFC"}
_BYTE_DECODER = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
_SPM_NORMALIZER = {"type": "Sequence", "normalizers": [
    {"type": "Prepend", "prepend": SPACE}, {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}]}
_SPM_DECODER = {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": SPACE}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}


@dataclass(frozen=True)
class Spec:
    """The parts of one real tokenizer.json a GGUF vocabulary does not carry."""

    pre_tokenizer: dict | None
    normalizer: dict | None = None
    decoder: dict | None = field(default_factory=lambda: dict(_BYTE_DECODER))
    ignore_merges: bool = False
    rstrip: tuple[str, ...] = ()


SPECS: dict[str, Spec] = {
    "gemma-4": Spec({"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False},
                    {"type": "Replace", "pattern": {"String": " "}, "content": SPACE},
                    {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
                                                      {"type": "ByteFallback"}, {"type": "Fuse"}]}),
    "llama-bpe": Spec(_splits_then_bytes(LLAMA3_PATTERN), ignore_merges=True),
    "qwen2": Spec(_splits_then_bytes(QWEN_PATTERN), _NFC),
    "qwen35": Spec(_splits_then_bytes(QWEN35_PATTERN)),  # no NFC: the .out keeps decomposed text
    "gpt-2": Spec(_byte_level(True)),
    "llama-spm": Spec(None, _SPM_NORMALIZER, _SPM_DECODER),
    "phi-3": Spec(None, _SPM_NORMALIZER, _SPM_DECODER, rstrip=PHI3_RSTRIP),
    "deepseek-llm": Spec(_splits_then_bytes(*DEEPSEEK_LLM_SPLITS)),
    "deepseek-coder": Spec(_splits_then_bytes(*DEEPSEEK_CODER_SPLITS)),
    "falcon": Spec({"type": "Sequence", "pretokenizers": [
        {"type": "Punctuation", "behavior": "Contiguous"}, _byte_level(True), _digits(False),
        _split("[0-9][0-9][0-9]")]}),
    "starcoder": Spec({"type": "Sequence", "pretokenizers": [_digits(True), _byte_level(True)]}),
    "command-r": Spec({"type": "Sequence", "pretokenizers": [_digits(True), _byte_level(True)]}, _NFC),
}


def spm_merges(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """The merges of a SentencePiece BPE vocabulary: every split of a piece into two pieces, ranked
    by the piece's score (highest first), ties by the lengths of the parts and then by their ids."""
    found = []
    for piece, idx in vocab.items():
        local = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found += [(scores[idx], a, b) for a, b in local]
    found.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(a, b) for _, a, b in found]


def _added_tokens(tokens: list[str], types: list[int], spec: Spec) -> list[dict[str, Any]]:
    out = []
    for idx, (text, kind) in enumerate(zip(tokens, types)):
        if kind in (3, 4):
            out.append({"id": idx, "content": text, "single_word": False, "lstrip": False,
                        "rstrip": text in spec.rstrip, "normalized": False, "special": kind == 3})
    return out


def tokenizer_json(name: str) -> dict[str, Any]:
    """The rebuilt tokenizer.json of ``ggml-vocab-{name}.gguf``."""
    meta = real_vocab(name).metadata
    spec = SPECS[name]
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta["tokenizer.ggml.token_type"]
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        merges = spm_merges(vocab, meta["tokenizer.ggml.scores"])
    byte_fallback = meta["tokenizer.ggml.model"] != "gpt2"
    model = {"type": "BPE", "dropout": None, "unk_token": tokens[meta["tokenizer.ggml.unknown_token_id"]]
             if byte_fallback else None, "continuing_subword_prefix": None, "end_of_word_suffix": None,
             "fuse_unk": byte_fallback, "byte_fallback": byte_fallback, "ignore_merges": spec.ignore_merges,
             "vocab": vocab, "merges": [list(m) for m in merges]}
    return {"version": "1.0", "truncation": None, "padding": None,
            "added_tokens": _added_tokens(tokens, types, spec), "normalizer": spec.normalizer,
            "pre_tokenizer": spec.pre_tokenizer, "post_processor": None, "decoder": spec.decoder, "model": model}


def rebuild(name: str, folder: Path) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` of ``name`` into ``folder``."""
    meta = real_vocab(name).metadata
    tokens = meta["tokenizer.ggml.tokens"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json(name), ensure_ascii=False), encoding="utf-8")

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[idx] if isinstance(idx, int) and 0 <= idx < len(tokens) else None

    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": token("bos"), "eos_token": token("eos"),
              "unk_token": token("unknown"), "add_bos_token": False, "add_eos_token": False,
              "clean_up_tokenization_spaces": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return folder
