"""The pipeline part of MNN's tokenizer file: normalizer, pre-tokenizer, BPE model, decoder.

Each HF ``tokenizer.json`` component is written with the type codes of MNN 3.6.1's loader
(``PipelineTokenizer::load_vocab_binary``) when the runtime computes exactly what HF computes,
and refused (``Unsupported``, with the reason) when it would not. A few components are exact on
all but some inputs (``Body.notes`` says which), for example NFC, which the runtime cannot apply.

What the runtime does (tokenizer.cpp, unicode.cpp) that decides the rules here:

* Digits pre-tokenizer: only ASCII digits, and nothing at all without ``individual_digits``; HF
  splits on every Unicode number, so it is written as the Split regex ``\\p{N}`` (``\\p{N}+``).
* ByteLevel pre-tokenizer: optional GPT-2 regex, then every byte mapped to its GPT-2 character;
  it has no ``add_prefix_space``. Split: a regex (ASCII: regex.py; with non-ASCII
  characters, rewritten for std::wregex: wide_regex.py), ``invert`` and the
  behaviors Isolated, Removed, MergedWithPrevious; MergedWithPrevious also merges a match into a
  directly preceding match, which HF does not.
* BPE: the word's characters (or, without ByteLevel, its characters and ``<0xNN>`` byte
  pieces) are merged lowest rank first; there is no whole-word lookup, so HF's ``ignore_merges``
  is only exact when every vocabulary word the pre-tokenizer can produce is its own merge result.
  A character missing from the vocabulary is dropped (HF: ``<unk>``), so a model needs byte
  fallback or a ByteLevel pre-tokenizer whose 256 byte characters are all in the vocabulary.
* Decoder type 0 is ByteLevel (and switches single-id decoding to the byte map), so "no
  decoder" is written as an empty Sequence.
* Single-id decoding (what generation streams) ignores the decoder chain: see stream.py.
  The vocabulary row of an added token that BPE cannot reach (no merge's part or result, not a
  character or byte piece BPE looks up) is only read by that decode, whether or not the model
  vocabulary lists it, so it is respelled where needed to make the runtime stream what HF's
  decoder gives for it.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field

from llmexport.mnn.tokenizer.byte_level import byte_level_chars
from llmexport.mnn.tokenizer.pieces import decoder_has_byte_level, hf_piece_bytes, runtime_piece_bytes, runtime_spelling
from llmexport.mnn.tokenizer.regex import UnsupportedRegex, check_split_regex, end_of_line_as_lookahead, escape_literal
from llmexport.mnn.tokenizer.whole_words import APPROXIMATE_FLAG, IgnoreMergesDifference, measure_ignore_merges
from llmexport.mnn.tokenizer.wide_regex import WREGEX_NOTE, rewrite_for_wregex

__all__ = ["Body", "Unsupported", "encode_body", "unreachable_words", "decoder_has_byte_level",
           "GPT2_PATTERN", "NFC_NOTE", "u8", "u32", "string"]

_NORM_NONE, _NORM_PREPEND, _NORM_REPLACE, _NORM_SEQUENCE = 0, 2, 3, 4
_PRE_NONE, _PRE_BYTE_LEVEL, _PRE_SPLIT, _PRE_SEQUENCE = 0, 1, 4, 6
_SPLIT_BEHAVIOR = {"Isolated": 0, "Removed": 1, "MergedWithPrevious": 2}
_MODEL_BPE = 0
_DEC_BYTE_LEVEL, _DEC_BYTE_FALLBACK, _DEC_FUSE, _DEC_REPLACE, _DEC_STRIP, _DEC_SEQUENCE = 0, 1, 4, 5, 6, 7

# The regex HF's ByteLevel pre-tokenizer applies with use_regex (also MNN's, tokenizer.cpp).
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
NFC_NOTE = ("normalizer NFC: MNN's runtime has no NFC, so text that is not in NFC (decomposed accents, "
            "compatibility ideographs) encodes differently; unicodedata.normalize('NFC', text) first is exact")


class Unsupported(ValueError):
    pass


def u8(v: int) -> bytes:
    return struct.pack("<B", v)


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def string(s: str | bytes) -> bytes:
    data = s.encode("utf-8") if isinstance(s, str) else s
    if len(data) > 0xFFFF:
        raise ValueError(f"string of {len(data)} bytes does not fit the u16 length field")
    return struct.pack("<H", len(data)) + data


@dataclass
class Body:
    """The encoded pipeline and what the rest of the file needs to know about it."""

    data: bytes = b""
    pieces: list[str] = field(default_factory=list)  # id -> the vocabulary row the file holds
    byte_level: bool = False  # ByteLevel pre-tokenizer: words are byte characters
    byte_level_decoder: bool = False  # the runtime decodes single ids through the byte map
    unsafe_chars: set[str] = field(default_factory=set)  # text characters the runtime may encode differently
    ignore_merges_difference: IgnoreMergesDifference | None = None
    notes: list[str] = field(default_factory=list)


def _pattern(node: dict, what: str) -> tuple[str, bool]:
    """(pattern, is_regex) of a Split/Replace node."""
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        return pattern, False
    if isinstance(pattern, dict) and isinstance(pattern.get("String"), str):
        return pattern["String"], False
    if isinstance(pattern, dict) and isinstance(pattern.get("Regex"), str):
        return pattern["Regex"], True
    raise Unsupported(f"{what} with pattern {pattern!r}")


def _normalizer(node: dict | None, body: Body) -> bytes | None:
    """Encoded normalizer, or None for one the runtime leaves out (NFC, see NFC_NOTE)."""
    if node is None:
        return u8(_NORM_NONE)
    kind = node.get("type")
    if kind == "Replace":
        pattern, regex = _pattern(node, "Replace normalizer")
        if regex:
            raise Unsupported(f"Replace normalizer with a regex {pattern!r} (the runtime replaces literal text)")
        return u8(_NORM_REPLACE) + string(pattern) + string(node.get("content", ""))
    if kind == "Prepend":
        return u8(_NORM_PREPEND) + string(node.get("prepend", ""))
    if kind == "NFC":
        body.notes.append(NFC_NOTE)
        return None
    if kind == "Sequence":
        children = [c for c in (_normalizer(n, body) for n in node.get("normalizers", [])) if c is not None]
        return u8(_NORM_SEQUENCE) + u32(len(children)) + b"".join(children)
    raise Unsupported(f"normalizer {kind!r}")


def _split(node: dict, body: Body, literal_removed_by_normalizer: bool) -> bytes:
    pattern, regex = _pattern(node, "Split pre-tokenizer")
    behavior = node.get("behavior", "Isolated")
    if behavior not in _SPLIT_BEHAVIOR:
        raise Unsupported(f"Split pre-tokenizer behavior {behavior!r} (supported: {', '.join(_SPLIT_BEHAVIOR)})")
    if regex:
        try:
            if pattern.isascii():
                pattern = end_of_line_as_lookahead(pattern)
                body.unsafe_chars |= check_split_regex(pattern).unsafe_chars()
            else:
                pattern = rewrite_for_wregex(pattern)
                body.notes.append(WREGEX_NOTE)
        except UnsupportedRegex as exc:
            raise Unsupported(f"Split pre-tokenizer: {exc}") from None
    else:
        if not pattern or any(ord(c) < 0x08 for c in pattern):
            raise Unsupported(f"Split pre-tokenizer with pattern {pattern!r}")
        pattern = escape_literal(pattern)
        if not pattern.isascii():
            pattern = rewrite_for_wregex(pattern)  # a string of literals: no Unsupported case
            body.notes.append(WREGEX_NOTE)
    if behavior == "MergedWithPrevious" and not literal_removed_by_normalizer:
        # The runtime also merges a match into a directly preceding match ("a  b" split on " ").
        raise Unsupported("Split pre-tokenizer MergedWithPrevious (the runtime merges adjacent matches, HF does not)")
    return u8(_PRE_SPLIT) + string(pattern) + u8(int(bool(node.get("invert", False)))) + u8(_SPLIT_BEHAVIOR[behavior])


def _byte_level(node: dict, body: Body) -> bytes:
    if node.get("add_prefix_space", False):
        raise Unsupported("ByteLevel pre-tokenizer with add_prefix_space=true (the runtime has no such field)")
    if body.byte_level:
        raise Unsupported("two ByteLevel pre-tokenizers")
    body.byte_level = True
    use_regex = bool(node.get("use_regex", True))
    if use_regex:
        body.unsafe_chars |= check_split_regex(GPT2_PATTERN).unsafe_chars()
    return u8(_PRE_BYTE_LEVEL) + u8(int(use_regex))


def _pre_tokenizer(node: dict | None, body: Body, removed_literals: set[str]) -> bytes:
    if node is None:
        return u8(_PRE_NONE)
    kind = node.get("type")
    if body.byte_level:
        raise Unsupported(f"pre-tokenizer {kind!r} after ByteLevel")
    if kind == "Split":
        pattern, regex = _pattern(node, "Split pre-tokenizer")
        return _split(node, body, not regex and pattern in removed_literals)
    if kind == "ByteLevel":
        return _byte_level(node, body)
    if kind == "Digits":
        # HF splits on char::is_numeric (Nd, Nl, No = \p{N}); the runtime's own Digits
        # pre-tokenizer knows only ASCII digits, and with individual_digits=false splits nothing.
        pattern = r"\p{N}" if node.get("individual_digits", False) else r"\p{N}+"
        return _split({"pattern": {"Regex": pattern}, "behavior": "Isolated"}, body, False)
    if kind == "Sequence":
        children = node.get("pretokenizers", [])
        return u8(_PRE_SEQUENCE) + u32(len(children)) + b"".join(_pre_tokenizer(c, body, removed_literals)
                                                                  for c in children)
    raise Unsupported(f"pre-tokenizer {kind!r}")


def _removed_literals(node: dict | None) -> set[str]:
    """Literal strings the normalizer's last step replaces everywhere by text without them
    (Gemma's " " -> "▁"): a Split on one of them never matches, whatever its behavior."""
    if node is not None and node.get("type") == "Sequence":
        node = (node.get("normalizers") or [None])[-1]
    if node is None or node.get("type") != "Replace":
        return set()
    pattern = node.get("pattern")
    text = pattern.get("String") if isinstance(pattern, dict) else None
    return {text} if isinstance(text, str) and text and text not in node.get("content", "") else set()


def _decoder(node: dict | None, body: Body) -> bytes:
    if node is None:
        return u8(_DEC_SEQUENCE) + u32(0)
    kind = node.get("type")
    if kind == "ByteLevel":
        body.byte_level_decoder = True
        return u8(_DEC_BYTE_LEVEL)
    if kind == "Replace":
        pattern, regex = _pattern(node, "Replace decoder")
        if regex:
            raise Unsupported(f"Replace decoder with a regex {pattern!r}")
        return u8(_DEC_REPLACE) + string(pattern) + string(node.get("content", ""))
    if kind == "ByteFallback":
        return u8(_DEC_BYTE_FALLBACK)
    if kind == "Fuse":
        return u8(_DEC_FUSE)
    if kind == "Strip":
        return u8(_DEC_STRIP) + string(node.get("content", " ")) + u32(node.get("start", 0)) + u32(node.get("stop", 0))
    if kind == "Sequence":
        children = node.get("decoders", [])
        return u8(_DEC_SEQUENCE) + u32(len(children)) + b"".join(_decoder(c, body) for c in children)
    raise Unsupported(f"decoder {kind!r}")


def _merge_pair(merge) -> tuple[str, str]:
    if isinstance(merge, str):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise Unsupported(f"merge {merge!r}")
        return parts[0], parts[1]
    if isinstance(merge, (list, tuple)) and len(merge) == 2:
        return merge[0], merge[1]
    raise Unsupported(f"merge {merge!r}")


def _vocabulary(model: dict, added: list[dict]) -> tuple[dict[str, int], dict[int, str]]:
    vocab: dict[str, int] = model.get("vocab", {})
    if not isinstance(vocab, dict) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                              for i in vocab.values()):
        raise Unsupported("BPE vocabulary that is not an object of piece -> non-negative integer id")
    vocab = dict(vocab)
    by_id: dict[int, str] = {}
    for piece, idx in vocab.items():
        if idx in by_id:
            raise Unsupported(f"vocabulary id {idx} used twice ({by_id[idx]!r}, {piece!r})")
        by_id[idx] = piece
    # Added tokens outside the model vocabulary still need a row: the runtime sizes its id table
    # by the vocabulary count and decodes ids through it.
    for tok in added:
        if tok["id"] not in by_id:
            by_id[tok["id"]] = tok["content"]
            vocab.setdefault(tok["content"], tok["id"])
    if by_id and (min(by_id) != 0 or max(by_id) != len(by_id) - 1):  # ids are distinct: 0..n-1 is all of them
        missing = [i for i in range(len(by_id) + 1) if i not in by_id][:10]
        raise Unsupported(f"vocabulary ids are not contiguous 0..{len(by_id) - 1} (highest {max(by_id)}, "
                          f"missing ids such as {missing})")
    return vocab, by_id


def _check_byte_coverage(model: dict, vocab: dict[str, int], body: Body) -> None:
    if body.byte_level:
        missing = [c for c in byte_level_chars() if c not in vocab]
        if missing:
            raise Unsupported(f"ByteLevel vocabulary lacks {len(missing)} byte character(s) such as {missing[0]!r} "
                              "(the runtime drops them)")
    elif model.get("byte_fallback"):
        for b in range(256):
            if f"<0x{b:02X}>" not in vocab:
                raise Unsupported(f"byte_fallback vocabulary lacks the byte piece <0x{b:02X}>")
    else:
        raise Unsupported("BPE model without byte_fallback and without a ByteLevel pre-tokenizer "
                          "(the runtime drops unknown characters instead of <unk>)")


def _looked_up_by_text(row: str) -> bool:
    """BPE's first step looks a word's symbols up by their text: its characters and, for a
    character the vocabulary lacks, its ``<0xHH>`` byte pieces (BPEModel::tokenize, ``%02X``)."""
    return len(row) == 1 or _BYTE_PIECE.fullmatch(row) is not None


_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")


def _respell_added_rows(added: list[dict], by_id: dict[int, str], merge_ids: set[int],
                        decoder: dict | None, keep_ids: frozenset[int]) -> None:
    """Respell, in ``by_id``, the rows of added tokens whose single-id decode in the runtime
    would differ from HF's decoder on that token (for example ``<｜fim▁hole｜>`` or DeepSeek's
    ``<｜begin▁of▁sentence｜>`` in a ByteLevel vocabulary, which HF keeps verbatim and the runtime
    would stream with a space). Only rows BPE cannot reach are respelled, whether or not the
    model vocabulary lists the token (a tokenizer.json may list it in both, as the DeepSeek files
    rebuilt from GGUF do): BPE reaches a row by a merge or by looking its text up
    (``_looked_up_by_text``), so one that is neither is read by nothing but the runtime's
    single-id decode; the new spelling is checked to be no other row's text. Encoding matches
    added tokens by their content, which the file's added-token block keeps. ``keep_ids`` (the
    header's special list, matched by their decoded text) keep their content."""
    byte_level = decoder_has_byte_level(decoder)
    taken = set(by_id.values())
    for tok in added:
        idx, content = tok["id"], tok["content"]
        if idx in merge_ids or idx in keep_ids or by_id.get(idx) != content or _looked_up_by_text(content):
            continue
        target = hf_piece_bytes(content, decoder)
        if target is None or runtime_piece_bytes(content, byte_level=byte_level) == target:
            continue
        spelled = runtime_spelling(target, byte_level=byte_level)
        if spelled is None or spelled in taken or _looked_up_by_text(spelled):
            continue
        by_id[idx] = spelled
        taken.add(spelled)


def _bpe_model(model: dict, added: list[dict], body: Body, decoder: dict | None = None,
               keep_ids: frozenset[int] = frozenset()) -> bytes:
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise Unsupported(f"BPE model with {key}={model[key]!r}")
    if model.get("dropout"):
        raise Unsupported("BPE model with dropout")
    vocab, by_id = _vocabulary(model, added)
    _check_byte_coverage(model, vocab, body)

    rank_of: dict[tuple[int, int], int] = {}
    merge_ids: set[int] = set()  # rows BPE reaches through merges
    for rank, merge in enumerate(model.get("merges", [])):
        left, right = _merge_pair(merge)
        if left not in vocab or right not in vocab or left + right not in vocab:
            raise Unsupported(f"merge {left!r} + {right!r} refers to pieces outside the vocabulary")
        rank_of[(vocab[left], vocab[right])] = rank  # a later duplicate wins, as in `tokenizers`
        merge_ids.update((vocab[left], vocab[right], vocab[left + right]))

    _respell_added_rows(added, by_id, merge_ids, decoder, keep_ids)
    body.pieces = [by_id[i] for i in range(len(by_id))]
    rows = sorted((piece.encode("utf-8"), idx) for idx, piece in by_id.items())
    # byte_fallback is not read by the 3.6.1 loader (the model always tries <0xNN> pieces);
    # byte_level 0: the pre-tokenizer, not the model, maps bytes to characters.
    out = [u8(_MODEL_BPE), u32(len(rows)), u8(int(bool(model.get("byte_fallback")))), u8(0), u32(len(rank_of))]
    out += [string(piece) + u32(idx) for piece, idx in rows]
    merges = sorted(rank_of.items(), key=lambda kv: (kv[0][0] << 32) | kv[0][1])
    out += [u32(a) + u32(b) + u32(r) for (a, b), r in merges]
    return b"".join(out)


def unreachable_words(tj: dict) -> list[str]:
    """Vocabulary words that ``ignore_merges`` makes one token but merges alone do not.

    A piece matters only when the pre-tokenizer can produce it as a whole word: its text (bytes
    for a ByteLevel vocabulary) pre-tokenizes back into exactly that piece. Returns their texts.
    """
    from tokenizers import Tokenizer

    spec = json.loads(json.dumps(tj))
    spec["model"]["ignore_merges"] = False
    tok = Tokenizer.from_str(json.dumps(spec))
    added = {t["content"] for t in tj.get("added_tokens", [])}
    char_bytes = {c: b for b, c in enumerate(byte_level_chars())}
    byte_level = _has_byte_level(tj.get("pre_tokenizer"))
    bad = []
    for piece, idx in tj["model"].get("vocab", {}).items():
        if piece in added or len(piece) < 2:
            continue
        if byte_level:
            try:
                text = bytes(char_bytes[c] for c in piece).decode("utf-8")
            except (KeyError, UnicodeDecodeError):
                continue  # not a whole-character byte string: never a whole word
        else:
            text = piece
        if tok.pre_tokenizer is not None and [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(text)] != [piece]:
            continue
        if [t.id for t in tok.model.tokenize(piece)] != [idx]:
            bad.append(text)
    return bad


def _has_byte_level(node: dict | None) -> bool:
    if node is None:
        return False
    if node.get("type") == "Sequence":
        return any(_has_byte_level(c) for c in node.get("pretokenizers", []))
    return node.get("type") == "ByteLevel"


def encode_body(tj: dict, keep_ids: frozenset[int] = frozenset(), approximate_ignore_merges: bool = False) -> Body:
    """Normalizer + pre-tokenizer + BPE model + decoder of ``tokenizer.json`` in MNN's codes.

    ``keep_ids``: added tokens whose vocabulary row must stay their content (see
    ``_respell_added_rows``); ``approximate_ignore_merges``: write a vocabulary with words only
    HF's whole-word lookup reaches anyway and measure the difference (whole_words.py)."""
    body = Body()
    model = tj.get("model") or {}
    mtype = model.get("type") or ("BPE" if "merges" in model else None)
    if mtype != "BPE":
        raise Unsupported(f"tokenizer model type {mtype!r} (supported: BPE with byte_fallback or ByteLevel)")
    normalizer = _normalizer(tj.get("normalizer"), body)
    parts = [normalizer if normalizer is not None else u8(_NORM_NONE),
             _pre_tokenizer(tj.get("pre_tokenizer"), body, _removed_literals(tj.get("normalizer"))),
             _bpe_model(model, list(tj.get("added_tokens", [])), body, tj.get("decoder"), keep_ids),
             _decoder(tj.get("decoder"), body)]
    if model.get("ignore_merges"):
        bad = unreachable_words(tj)
        if bad and approximate_ignore_merges:
            body.ignore_merges_difference = measure_ignore_merges(tj, bad)
            body.notes.append(body.ignore_merges_difference.summary())
        elif bad:
            raise Unsupported(
                f"BPE model with ignore_merges=true: {len(bad)} vocabulary word(s) such as {sorted(bad)[:3]} are "
                "single tokens in HF but not reachable by merges, and MNN 3.6.1's BPE has no whole-word lookup "
                f"({APPROXIMATE_FLAG} exports it anyway and records the difference)")
    body.data = b"".join(parts)
    return body
