"""A GGUF file's vocabulary (``tokenizer.ggml.*``) rebuilt as the HF ``tokenizer.json`` it came from.

The file holds the tokens, token types, scores, merges and the name of the pre-tokenizer
(``tokenizer.ggml.pre``, llama.cpp's name for a known HF tokenizer). The rebuild: the vocabulary and
merges as stored (SentencePiece vocabularies store no merges: they are derived from the scores as
``transformers``' SentencePiece converter derives them), the added tokens from the token types
(3 control = special, 4 user-defined = added, not special), and the normalizer / pre-tokenizer /
decoder of the HF tokenizer that the pre-tokenizer name stands for (written from the regexes
llama.cpp's ``llama-vocab.cpp`` quotes from those tokenizer.json files). Flags a GGUF file does not
keep (``ignore_merges``) are set as the real tokenizer.json files have them.
tests/test_tokenizer_real_vocab.py proves the rebuild of llama.cpp's own test vocabularies against
the ids HF produced (their ``.inp``/``.out`` files); tests/test_gguf_tokenizer.py the rebuild of
files converted by ``convert_hf_to_gguf.py`` against the tokenizer they were converted from.

Stop ids are llama.cpp's end-of-generation set (``llama-vocab.cpp``): eos, eot and eom ids and the
tokens whose text it recognises as an end of turn (``EOG_TEXTS``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from llmexport.errors import InputError

# The split regexes of the real tokenizers (tiktoken's cl100k-style pattern; Qwen2 keeps one
# digit per piece, Llama-3 up to three).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")

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


BPE_PRE: dict[str, Spec] = {
    "llama-bpe": Spec(_splits_then_bytes(LLAMA3_PATTERN), ignore_merges=True),
    # LiquidAI's LFM2 / LFM2.5: llama-vocab.cpp tokenizes "lfm2" as "llama-bpe" (LLAMA3 regex, ignore_merges)
    "lfm2": Spec(_splits_then_bytes(LLAMA3_PATTERN), ignore_merges=True),
    "qwen2": Spec(_splits_then_bytes(QWEN_PATTERN), _NFC),
    "qwen35": Spec(_splits_then_bytes(QWEN35_PATTERN)),  # no NFC: llama.cpp's .out keeps decomposed text
    "gpt-2": Spec(_byte_level(True)),
    "deepseek-llm": Spec(_splits_then_bytes(*DEEPSEEK_LLM_SPLITS)),
    "deepseek-coder": Spec(_splits_then_bytes(*DEEPSEEK_CODER_SPLITS)),
    "falcon": Spec({"type": "Sequence", "pretokenizers": [
        {"type": "Punctuation", "behavior": "Contiguous"}, _byte_level(True), _digits(False),
        _split("[0-9][0-9][0-9]")]}),
    "starcoder": Spec({"type": "Sequence", "pretokenizers": [_digits(True), _byte_level(True)]}),
    "command-r": Spec({"type": "Sequence", "pretokenizers": [_digits(True), _byte_level(True)]}, _NFC),
}
SPM = Spec(None, _SPM_NORMALIZER, _SPM_DECODER)
#: the Gemma tokenizer.json (Gemma 3 and 4: every space as U+2581, no dummy prefix; the same parts for
#: ``tokenizer.ggml.model`` ``gemma4`` and for a ``llama`` (SentencePiece) vocabulary without ``add_space_prefix``)
GEMMA4 = Spec({"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False},
              {"type": "Replace", "pattern": {"String": " "}, "content": SPACE},
              {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
                                                {"type": "ByteFallback"}, {"type": "Fuse"}]})
#: token texts llama.cpp ends generation on (llama-vocab.cpp, ``special_eog_ids``)
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
             "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>")


def spec_of(meta: dict[str, Any], where: str) -> Spec:
    """The parts of the HF tokenizer the file's ``tokenizer.ggml.model`` / ``pre`` stand for."""
    model = meta.get("tokenizer.ggml.model")
    if model == "gpt2":
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in BPE_PRE:
            raise InputError(f"{where}: tokenizer.ggml.pre {pre!r} is not supported (supported: {', '.join(BPE_PRE)})")
        return BPE_PRE[pre]
    if model == "llama":  # Gemma's SentencePiece adds no dummy prefix: the Gemma tokenizer.json's parts
        return SPM if meta.get("tokenizer.ggml.add_space_prefix", True) else GEMMA4
    if model == "gemma4":
        return GEMMA4
    raise InputError(f"{where}: tokenizer.ggml.model {model!r} is not supported (supported: gpt2, llama, gemma4)")


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


def _tokens(meta: dict[str, Any], where: str) -> tuple[list[str], list[int]]:
    tokens, types = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.token_type")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise InputError(f"{where}: tokenizer.ggml.tokens is missing or not a list of strings")
    if not isinstance(types, list) or len(types) != len(tokens):
        raise InputError(f"{where}: tokenizer.ggml.token_type must list one type per token ({len(tokens)})")
    return tokens, types


def _bos_processor(bos: str, bos_id: int) -> dict[str, Any]:
    """HF's post-processor that puts bos before every sequence (``tokenizer.ggml.add_bos_token``)."""
    special = {"SpecialToken": {"id": bos, "type_id": 0}}
    return {"type": "TemplateProcessing", "single": [special, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [special, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}


def tokenizer_json(meta: dict[str, Any], where: str, spec: Spec | None = None) -> dict[str, Any]:
    """The rebuilt tokenizer.json of a GGUF file's metadata (``spec``: the parts the file does
    not carry, else those its ``tokenizer.ggml.model`` / ``pre`` stand for)."""
    spec = spec or spec_of(meta, where)
    tokens, types = _tokens(meta, where)
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    elif "tokenizer.ggml.scores" in meta:
        merges = spm_merges(vocab, meta["tokenizer.ggml.scores"])
    else:
        raise InputError(f"{where}: tokenizer.ggml.merges (or scores) is missing")
    byte_fallback = meta["tokenizer.ggml.model"] != "gpt2"
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    model = {"type": "BPE", "dropout": None, "unk_token": tokens[unk] if byte_fallback and unk is not None else None,
             "continuing_subword_prefix": None, "end_of_word_suffix": None,
             "fuse_unk": byte_fallback, "byte_fallback": byte_fallback, "ignore_merges": spec.ignore_merges,
             "vocab": vocab, "merges": [list(m) for m in merges]}
    bos = _token(meta, tokens, "bos")
    post = _bos_processor(bos, tokens.index(bos)) if bos is not None and meta.get("tokenizer.ggml.add_bos_token") \
        else None
    return {"version": "1.0", "truncation": None, "padding": None,
            "added_tokens": _added_tokens(tokens, types, spec), "normalizer": spec.normalizer,
            "pre_tokenizer": spec.pre_tokenizer, "post_processor": post, "decoder": spec.decoder, "model": model}


def _token(meta: dict[str, Any], tokens: list[str], key: str) -> str | None:
    idx = meta.get(f"tokenizer.ggml.{key}_token_id")
    return tokens[idx] if isinstance(idx, int) and 0 <= idx < len(tokens) else None


def stop_ids(meta: dict[str, Any], where: str) -> list[int]:
    """llama.cpp's end-of-generation ids: eos, eot, eom and the tokens ``EOG_TEXTS`` names."""
    tokens, _ = _tokens(meta, where)
    ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    ids += [i for i, t in enumerate(tokens) if t in EOG_TEXTS]
    return sorted({i for i in ids if isinstance(i, int) and 0 <= i < len(tokens)})


def tokenizer_config(meta: dict[str, Any], where: str) -> dict[str, Any]:
    """tokenizer_config.json: special tokens, the chat template (``tokenizer.chat_template``)."""
    tokens, _ = _tokens(meta, where)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": _token(meta, tokens, "bos"),
              "eos_token": _token(meta, tokens, "eos"), "unk_token": _token(meta, tokens, "unknown"),
              "pad_token": _token(meta, tokens, "padding"),
              "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
              "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
              "clean_up_tokenization_spaces": False}
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return config


def with_rstrip(spec: Spec, texts: tuple[str, ...]) -> Spec:
    """``spec`` with these added tokens stripping the spaces after them (a flag GGUF does not keep)."""
    return replace(spec, rstrip=texts)
