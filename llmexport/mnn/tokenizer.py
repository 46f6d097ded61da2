"""Write a HuggingFace `tokenizer.json` as the tokenizer file MNN's LLM runtime reads.

The target is the "pipeline" tokenizer of MNN 3.6.1 (`PipelineTokenizer` in
transformers/llm/engine/src/tokenizer/tokenizer.cpp, file type 4, usually named
`tokenizer.mtok`). Layout, all integers little-endian:

* three text lines: `430 4` (magic number, type), `<n_special> <n_stop> <n_prefix>`, then those
  ids separated by spaces (special ids, stop ids, prefix ids);
* a binary body: normalizer, pre-tokenizer, model, decoder (each a type byte plus fields,
  sequences nest), the added tokens, then a trailer with the chat template (u32 length + UTF-8),
  the eos string (u16 length), a flags byte (bit 0: clean_up_tokenization_spaces) and the bos
  string (u16 length). Strings inside the body are a u16 byte length plus UTF-8 bytes.
* BPE model: type 0, u32 vocab size, u8 byte_fallback, u8 byte_level, u32 merge count, the
  vocabulary sorted by the bytes of the piece (piece, u32 id), then the merges sorted by
  `(left_id << 32) | right_id`, each as u32 left id, u32 right id, u32 rank.

How the runtime uses the header (3.6.1):

* prefix ids are put in front of EVERY `encode()` call (`Tokenizer::encode`), including each
  text segment between media tags of a multimodal prompt;
* special ids are split out of the text before the pipeline runs, first match in list order at
  each position (we list longer strings first so the longest special token wins, as in HF);
* stop ids end generation.

BOS: this writer leaves the prefix list empty by default and stores the bos string in the
trailer, where the runtime exposes it to chat templates as `bos_token`. A template that starts
with `{{ bos_token }}` then yields exactly one BOS (the rendered "<bos>" text is split out as the
special token), and media segments get no extra BOS. Consequently the runtime's `encode(text)`
equals HF's `tokenizer(text, add_special_tokens=False)`, and HF's `tokenizer(text)` is that with
BOS in front. `bos_prefix=True` writes BOS as a prefix token instead (then the chat template must
not write `{{ bos_token }}`, and multimodal prompts get one BOS per text segment).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

from llmexport.input_files import TOKENIZER_LIMIT, read_json, read_optional_json

__all__ = ["write_mnn_tokenizer", "mnn_tokenizer_bytes", "MNN_TOKENIZER_MAGIC", "MNN_TOKENIZER_PIPELINE"]

MNN_TOKENIZER_MAGIC = 430
MNN_TOKENIZER_PIPELINE = 4

# Binary type codes of the 3.6.1 loader (PipelineTokenizer::load_vocab_binary).
_NORM_NONE, _NORM_PREPEND, _NORM_REPLACE, _NORM_SEQUENCE = 0, 2, 3, 4
_PRE_NONE, _PRE_SPLIT, _PRE_SEQUENCE = 0, 4, 6
_SPLIT_BEHAVIOR = {"Isolated": 0, "Removed": 1, "MergedWithPrevious": 2}
_MODEL_BPE = 0
_DEC_BYTE_FALLBACK, _DEC_FUSE, _DEC_REPLACE, _DEC_STRIP, _DEC_SEQUENCE = 1, 4, 5, 6, 7
# Decoder type 0 means "ByteLevel" to the loader, so a missing decoder cannot be written as 0;
# an empty Sequence is the neutral decoder.

_REGEX_META = set(".^$*+?{}[]\\|()")

# End-of-turn markers that must stop generation when the tokenizer has them as single tokens.
_END_OF_TURN_TOKENS = ("<turn|>", "<end_of_turn>")


def _u8(v: int) -> bytes:
    return struct.pack("<B", v)


def _u16(v: int) -> bytes:
    return struct.pack("<H", v)


def _u32(v: int) -> bytes:
    return struct.pack("<I", v)


def _str(s: str | bytes) -> bytes:
    data = s.encode("utf-8") if isinstance(s, str) else s
    if len(data) > 0xFFFF:
        raise ValueError(f"string of {len(data)} bytes does not fit the u16 length field")
    return _u16(len(data)) + data


class _Unsupported(ValueError):
    pass


def _string_pattern(node: dict, what: str) -> str:
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        return pattern
    if isinstance(pattern, dict) and "String" in pattern:
        return pattern["String"]
    raise _Unsupported(f"{what} with pattern {pattern!r} (only literal String patterns are supported)")


def _normalizer(node: dict | None) -> bytes:
    if node is None:
        return _u8(_NORM_NONE)
    kind = node.get("type")
    if kind == "Replace":
        return _u8(_NORM_REPLACE) + _str(_string_pattern(node, "Replace normalizer")) + _str(node.get("content", ""))
    if kind == "Prepend":
        return _u8(_NORM_PREPEND) + _str(node.get("prepend", ""))
    if kind == "Sequence":
        children = node.get("normalizers", [])
        return _u8(_NORM_SEQUENCE) + _u32(len(children)) + b"".join(_normalizer(c) for c in children)
    raise _Unsupported(f"normalizer {kind!r}")


def _pre_tokenizer(node: dict | None) -> bytes:
    if node is None:
        return _u8(_PRE_NONE)
    kind = node.get("type")
    if kind == "Split":
        pattern = _string_pattern(node, "Split pre-tokenizer")
        # The runtime compiles the pattern as a regex: only plain literals mean the same thing.
        if not pattern or any(ch in _REGEX_META for ch in pattern):
            raise _Unsupported(f"Split pre-tokenizer with pattern {pattern!r} (regex metacharacters)")
        behavior = node.get("behavior", "Isolated")
        if behavior not in _SPLIT_BEHAVIOR:
            raise _Unsupported(f"Split pre-tokenizer behavior {behavior!r}")
        if node.get("invert", False):
            raise _Unsupported("Split pre-tokenizer with invert=true")
        return _u8(_PRE_SPLIT) + _str(pattern) + _u8(0) + _u8(_SPLIT_BEHAVIOR[behavior])
    if kind == "Sequence":
        children = node.get("pretokenizers", [])
        return _u8(_PRE_SEQUENCE) + _u32(len(children)) + b"".join(_pre_tokenizer(c) for c in children)
    raise _Unsupported(f"pre-tokenizer {kind!r}")


def _decoder(node: dict | None) -> bytes:
    if node is None:
        return _u8(_DEC_SEQUENCE) + _u32(0)
    kind = node.get("type")
    if kind == "Replace":
        return _u8(_DEC_REPLACE) + _str(_string_pattern(node, "Replace decoder")) + _str(node.get("content", ""))
    if kind == "ByteFallback":
        return _u8(_DEC_BYTE_FALLBACK)
    if kind == "Fuse":
        return _u8(_DEC_FUSE)
    if kind == "Strip":
        return _u8(_DEC_STRIP) + _str(node.get("content", " ")) + _u32(node.get("start", 0)) + _u32(node.get("stop", 0))
    if kind == "Sequence":
        children = node.get("decoders", [])
        return _u8(_DEC_SEQUENCE) + _u32(len(children)) + b"".join(_decoder(c) for c in children)
    raise _Unsupported(f"decoder {kind!r}")


def _merge_pair(merge) -> tuple[str, str]:
    if isinstance(merge, str):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise _Unsupported(f"merge {merge!r}")
        return parts[0], parts[1]
    if isinstance(merge, (list, tuple)) and len(merge) == 2:
        return merge[0], merge[1]
    raise _Unsupported(f"merge {merge!r}")


def _bpe_model(model: dict, added: list[dict]) -> bytes:
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise _Unsupported(f"BPE model with {key}={model[key]!r}")
    if model.get("dropout"):
        raise _Unsupported("BPE model with dropout")
    if model.get("ignore_merges"):
        raise _Unsupported("BPE model with ignore_merges=true")
    if not model.get("byte_fallback"):
        raise _Unsupported("BPE model without byte_fallback (the runtime drops unknown characters instead of <unk>)")

    vocab: dict[str, int] = model.get("vocab", {})
    if not isinstance(vocab, dict) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                              for i in vocab.values()):
        raise _Unsupported("BPE vocabulary that is not an object of piece -> non-negative integer id")
    vocab = dict(vocab)
    by_id: dict[int, str] = {}
    for piece, idx in vocab.items():
        if idx in by_id:
            raise _Unsupported(f"vocabulary id {idx} used twice ({by_id[idx]!r}, {piece!r})")
        by_id[idx] = piece
    # Added tokens outside the model vocabulary still need a row: the runtime sizes its id table
    # by the vocabulary count and decodes ids through it.
    for tok in added:
        if tok["id"] not in by_id:
            by_id[tok["id"]] = tok["content"]
            vocab.setdefault(tok["content"], tok["id"])
    if by_id and (min(by_id) != 0 or max(by_id) != len(by_id) - 1):  # ids are distinct: 0..n-1 is all of them
        missing = [i for i in range(len(by_id) + 1) if i not in by_id][:10]
        raise _Unsupported(f"vocabulary ids are not contiguous 0..{len(by_id) - 1} (highest {max(by_id)}, "
                           f"missing ids such as {missing})")
    for b in range(256):
        if f"<0x{b:02X}>" not in vocab:
            raise _Unsupported(f"byte_fallback vocabulary lacks the byte piece <0x{b:02X}>")

    rank_of: dict[tuple[int, int], int] = {}
    for rank, merge in enumerate(model.get("merges", [])):
        left, right = _merge_pair(merge)
        if left not in vocab or right not in vocab or left + right not in vocab:
            raise _Unsupported(f"merge {left!r} + {right!r} refers to pieces outside the vocabulary")
        rank_of[(vocab[left], vocab[right])] = rank  # a later duplicate wins, as in `tokenizers`

    rows = sorted((piece.encode("utf-8"), idx) for idx, piece in by_id.items())
    out = [_u8(_MODEL_BPE), _u32(len(rows)), _u8(1), _u8(0), _u32(len(rank_of))]
    out += [_str(piece) + _u32(idx) for piece, idx in rows]
    out += [_u32(a) + _u32(b) + _u32(r) for (a, b), r in sorted(rank_of.items(), key=lambda kv: (kv[0][0] << 32) | kv[0][1])]
    return b"".join(out)


def _token_text(value) -> str:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _generation_eos_ids(folder: Path) -> list[int]:
    path = folder / "generation_config.json"
    eos = (read_optional_json(path, what="generation config") or {}).get("eos_token_id")
    ids = [] if eos is None else [eos] if not isinstance(eos, list) else eos
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{path}: 'eos_token_id' must be a token id or a list of them, got {eos!r}")
    return ids


def _unique(ids: Iterable[int]) -> list[int]:
    seen: list[int] = []
    for i in ids:
        if i not in seen:
            seen.append(i)
    return seen


def _check_added_token(tok: dict, normalize) -> None:
    if tok.get("single_word"):
        raise _Unsupported(f"added token {tok['content']!r} with single_word=true")
    if tok.get("normalized") and not tok.get("special") and normalize is not None:
        # HF matches such a token in the normalized text, the runtime in the raw text.
        if normalize(tok["content"]) != tok["content"]:
            raise _Unsupported(f"added token {tok['content']!r} is normalized and the normalizer changes it")


def _hf_normalizer(tj_path: Path):
    from tokenizers import Tokenizer

    try:
        hf_norm = Tokenizer.from_file(str(tj_path)).normalizer
    except Exception as exc:  # the tokenizers library rejects the file
        raise _Unsupported(f"file that the tokenizers library cannot load ({exc})") from None
    return hf_norm.normalize_str if hf_norm is not None else None


def _runtime_decodes_verbatim(content: str) -> bool:
    # PipelineTokenizer::decode(int) turns "▁" into a space and "<0xNN>" into a byte; the special
    # list is matched against that decoded text, so only tokens it leaves alone may go there.
    return bool(content) and "\u2581" not in content and "<0x" not in content


def write_mnn_tokenizer(hf_tokenizer_dir: Path, out_path: Path, **options) -> None:
    """Write `mnn_tokenizer_bytes(hf_tokenizer_dir, **options)` to `out_path`."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_bytes(mnn_tokenizer_bytes(hf_tokenizer_dir, **options))


def _check_added_tokens(added, where: Path) -> list[dict]:
    if not isinstance(added, list) or not all(
            isinstance(t, dict) and isinstance(t.get("content"), str) and isinstance(t.get("id"), int)
            and not isinstance(t.get("id"), bool) and t["id"] >= 0 for t in added):
        raise ValueError(f"{where}: 'added_tokens' must list objects with a string 'content' and an integer 'id'")
    return list(added)


def mnn_tokenizer_bytes(
    hf_tokenizer_dir: Path,
    *,
    chat_template: str | None = None,
    stop_token_ids: Sequence[int] | None = None,
    bos_prefix: bool = False,
) -> bytes:
    """Convert `hf_tokenizer_dir/tokenizer.json` into MNN 3.6.1's pipeline tokenizer file.

    `chat_template` is stored in the file (an llm_config.json `jinja.chat_template` overrides it).
    Stop ids are the eos token, the ids in generation_config.json's `eos_token_id`, end-of-turn
    tokens (`<turn|>`, `<end_of_turn>`) when present, and `stop_token_ids`. See the module
    docstring for `bos_prefix`. Raises ValueError, naming the file, for tokenizer features the
    runtime cannot reproduce exactly (for example a Unigram or WordPiece model).
    """
    folder = Path(hf_tokenizer_dir)
    tj_path = folder / "tokenizer.json"
    tj = read_json(tj_path, TOKENIZER_LIMIT, "tokenizer file")
    tc_path = folder / "tokenizer_config.json"
    tc = read_optional_json(tc_path, TOKENIZER_LIMIT, "tokenizer config") or {}

    added = _check_added_tokens(tj.get("added_tokens", []), tj_path)
    model = tj.get("model") or {}
    if not isinstance(model, dict):
        raise ValueError(f"{tj_path}: 'model' must be an object")
    mtype = model.get("type") or ("BPE" if "merges" in model else None)
    try:
        if mtype != "BPE":
            raise _Unsupported(f"tokenizer model type {mtype!r} (supported: BPE with byte_fallback)")
        normalize = _hf_normalizer(tj_path) if tj.get("normalizer") is not None else None
        for tok in added:
            _check_added_token(tok, normalize)
        body = [_normalizer(tj.get("normalizer")), _pre_tokenizer(tj.get("pre_tokenizer")), _bpe_model(model, added), _decoder(tj.get("decoder"))]
    except _Unsupported as exc:
        raise ValueError(f"{tj_path}: unsupported {exc}") from None
    except (AttributeError, TypeError, KeyError) as exc:  # a node of the wrong JSON type
        raise ValueError(f"{tj_path}: malformed tokenizer ({type(exc).__name__}: {exc})") from None

    content_to_id = {tok["content"]: tok["id"] for tok in added}
    vocab = model.get("vocab", {})

    def token_id(text: str) -> int | None:
        if text in content_to_id:
            return content_to_id[text]
        return vocab.get(text)

    bos_text = _token_text(tc.get("bos_token"))
    eos_text = _token_text(tc.get("eos_token"))

    specials = [tok for tok in added if tok.get("special") and _runtime_decodes_verbatim(tok["content"])]
    specials.sort(key=lambda t: (-len(t["content"].encode("utf-8")), t["id"]))
    special_ids = _unique(t["id"] for t in specials)

    stop_ids: list[int] = []
    if eos_text and token_id(eos_text) is not None:
        stop_ids.append(token_id(eos_text))
    stop_ids += _generation_eos_ids(folder)
    stop_ids += [content_to_id[t] for t in _END_OF_TURN_TOKENS if t in content_to_id]
    stop_ids += list(stop_token_ids or [])
    stop_ids = _unique(stop_ids)

    prefix_ids: list[int] = []
    if bos_prefix:
        if not bos_text or token_id(bos_text) is None:
            raise ValueError(f"{tc_path}: bos_prefix requested but no bos_token in the vocabulary")
        prefix_ids = [token_id(bos_text)]

    header = (
        f"{MNN_TOKENIZER_MAGIC} {MNN_TOKENIZER_PIPELINE}\n"
        f"{len(special_ids)} {len(stop_ids)} {len(prefix_ids)}\n"
        + " ".join(str(i) for i in special_ids + stop_ids + prefix_ids)
        + "\n"
    ).encode("ascii")

    added_block = [_u32(len(added))]
    for tok in added:
        added_block.append(
            _u32(tok["id"])
            + _u8(int(bool(tok.get("special"))))
            + _u8(int(bool(tok.get("lstrip"))))
            + _u8(int(bool(tok.get("rstrip"))))
            + _str(tok["content"])
        )

    template = (chat_template or "").encode("utf-8")
    flags = 0x01 if tc.get("clean_up_tokenization_spaces") is True else 0
    trailer = _u32(len(template)) + template + _str(eos_text) + _u8(flags) + _str(bos_text)

    return header + b"".join(body) + b"".join(added_block) + trailer
