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
  that split ignores ``lstrip``/``rstrip``, so tokens with those flags are left to the pipeline's
  added-token step (``PipelineTokenizer::encode``: leftmost-longest match, then strips the
  whitespace before (lstrip) or after (rstrip) the token, as HF does). Its whitespace is C's
  ``isspace`` (ASCII); HF's is Unicode White_Space, so the non-ASCII White_Space characters are
  reported as unsafe characters when such a token exists (``STRIP_DIFFERENCES``);
* stop ids end generation.

Which HF components are written and which are refused: pipeline.py (and
regex.py for Split regexes). Stop ids come from the tokenizer (eos_token,
generation_config.json's eos_token_id) and from the model family (its end-of-turn tokens).

BOS: this writer leaves the prefix list empty by default and stores the bos string in the
trailer, where the runtime exposes it to chat templates as `bos_token`. A template that starts
with `{{ bos_token }}` then yields exactly one BOS (the rendered "<bos>" text is split out as the
special token), and media segments get no extra BOS. Consequently the runtime's `encode(text)`
equals HF's `tokenizer(text, add_special_tokens=False)`, and HF's `tokenizer(text)` is that with
BOS in front. `bos_prefix=True` writes BOS as a prefix token instead (then the chat template must
not write `{{ bos_token }}`, and multimodal prompts get one BOS per text segment).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from llmexport.mnn.tokenizer.byte_level import byte_level_chars
from llmexport.mnn.tokenizer.pieces import decoder_has_byte_level
from llmexport.mnn.tokenizer.pipeline import Body, Unsupported, encode_body, string, u8, u32
from llmexport.mnn.tokenizer.whole_words import IgnoreMergesDifference
from llmexport.source.input_files import TOKENIZER_LIMIT, read_json, read_optional_json

__all__ = ["write_mnn_tokenizer", "mnn_tokenizer_bytes", "convert_tokenizer", "MnnTokenizerFile",
           "MNN_TOKENIZER_MAGIC", "MNN_TOKENIZER_PIPELINE"]

log = logging.getLogger(__name__)

MNN_TOKENIZER_MAGIC = 430
MNN_TOKENIZER_PIPELINE = 4


@dataclass(frozen=True)
class MnnTokenizerFile:
    """The file's bytes, its stop ids, and where the runtime's encode differs from HF's.

    ``unsafe_chars``: text characters on which the runtime's encode may differ from HF's (the
    regex split's, regex.py, and ``STRIP_DIFFERENCES``); ``notes``: other inputs it
    encodes differently (e.g. text not in NFC); ``pieces``: id -> the vocabulary row written,
    which the runtime's single-id decode (what generation streams) starts from (stream.py);
    ``ignore_merges_difference``: what ``approximate_ignore_merges`` accepted (whole_words.py).
    """

    data: bytes
    stop_ids: tuple[int, ...]
    unsafe_chars: frozenset[str] = field(default_factory=frozenset)
    notes: tuple[str, ...] = ()
    pieces: tuple[str, ...] = ()
    ignore_merges_difference: IgnoreMergesDifference | None = None


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
        raise Unsupported(f"added token {tok['content']!r} with single_word=true")
    if tok.get("normalized") and not tok.get("special") and normalize is not None:
        # HF matches such a token in the normalized text, the runtime in the raw text.
        if normalize(tok["content"]) != tok["content"]:
            raise Unsupported(f"added token {tok['content']!r} is normalized and the normalizer changes it")


#: Unicode White_Space characters outside ASCII: HF's lstrip/rstrip strips them, the runtime's
#: (C ``isspace``) does not.
STRIP_DIFFERENCES = frozenset("\u0085\u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
                              "\u2009\u200a\u2028\u2029\u202f\u205f\u3000")


def _strips(tok: dict) -> bool:
    return bool(tok.get("lstrip") or tok.get("rstrip"))


def _check_added_overlaps(specials: list[dict], added: list[dict]) -> None:
    """The runtime splits the header's special tokens out of the text before the other added
    tokens; HF matches all of them in one leftmost-longest pass. Equal only if no header token
    can overlap another added token in some text."""
    header = {t["id"] for t in specials}
    others = [t["content"] for t in added if t["id"] not in header]
    for special in (t["content"] for t in specials):
        for other in others:
            if other in special or special in other or any(
                    special.endswith(other[:k]) or other.endswith(special[:k])
                    for k in range(1, min(len(special), len(other)))):
                raise Unsupported(f"added token {other!r} can overlap the special token {special!r}")


def _hf_normalizer(tj_path: Path):
    from tokenizers import Tokenizer

    try:
        hf_norm = Tokenizer.from_file(str(tj_path)).normalizer
    except Exception as exc:  # the tokenizers library rejects the file
        raise Unsupported(f"file that the tokenizers library cannot load ({exc})") from None
    return hf_norm.normalize_str if hf_norm is not None else None


def _runtime_decodes_verbatim(content: str, byte_level_decoder: bool) -> bool:
    # PipelineTokenizer::decode(int) turns "▁" into a space and "<0xNN>" into a byte, then (with
    # a ByteLevel decoder) maps byte characters back to bytes; the special list is matched
    # against that decoded text, so only tokens it leaves alone may go there. The others are
    # matched by the pipeline's added-token step, and their rows respelled so that decode(int)
    # gives HF's text (tokenizer_pipeline._respell_added_rows).
    if not content or "\u2581" in content or "<0x" in content:
        return False
    return not byte_level_decoder or all(c not in _BYTE_CHARS or 33 <= ord(c) <= 126 for c in content)


_BYTE_CHARS = frozenset(byte_level_chars())


def _stop_ids(folder: Path, tc: dict, token_id, end_of_turn: Sequence[str], extra: Sequence[int]) -> list[int]:
    eos_text = _token_text(tc.get("eos_token"))
    stop_ids: list[int] = []
    if eos_text and token_id(eos_text) is not None:
        stop_ids.append(token_id(eos_text))
    stop_ids += _generation_eos_ids(folder)
    stop_ids += [token_id(t) for t in end_of_turn if token_id(t) is not None]
    stop_ids += list(extra)
    return _unique(stop_ids)


def _check_added_tokens(added, where: Path) -> list[dict]:
    if not isinstance(added, list) or not all(
            isinstance(t, dict) and isinstance(t.get("content"), str) and isinstance(t.get("id"), int)
            and not isinstance(t.get("id"), bool) and t["id"] >= 0 for t in added):
        raise ValueError(f"{where}: 'added_tokens' must list objects with a string 'content' and an integer 'id'")
    return list(added)


def write_mnn_tokenizer(hf_tokenizer_dir: Path, out_path: Path, **options) -> MnnTokenizerFile:
    """Write `convert_tokenizer(hf_tokenizer_dir, **options)` to `out_path`."""
    converted = convert_tokenizer(hf_tokenizer_dir, **options)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_bytes(converted.data)
    return converted


def mnn_tokenizer_bytes(hf_tokenizer_dir: Path, **options) -> bytes:
    """The bytes of `convert_tokenizer(hf_tokenizer_dir, **options)`."""
    return convert_tokenizer(hf_tokenizer_dir, **options).data


def _encode_body(tj: dict, tj_path: Path, added: list[dict],
                 approximate_ignore_merges: bool = False) -> tuple[Body, list[dict]]:
    """The pipeline body and the special tokens the runtime's special list may hold."""
    try:
        byte_level_decoder = decoder_has_byte_level(tj.get("decoder"))
        specials = [tok for tok in added if tok.get("special") and not _strips(tok)
                    and _runtime_decodes_verbatim(tok["content"], byte_level_decoder)]
        body = encode_body(tj, frozenset(tok["id"] for tok in specials), approximate_ignore_merges)
        normalize = _hf_normalizer(tj_path) if tj.get("normalizer") is not None else None
        for tok in added:
            _check_added_token(tok, normalize)
        _check_added_overlaps(specials, added)
    except Unsupported as exc:
        raise ValueError(f"{tj_path}: unsupported {exc}") from None
    except (AttributeError, TypeError, KeyError) as exc:  # a node of the wrong JSON type
        raise ValueError(f"{tj_path}: malformed tokenizer ({type(exc).__name__}: {exc})") from None
    if any(_strips(tok) for tok in added):
        body.unsafe_chars |= STRIP_DIFFERENCES
    return body, specials


def convert_tokenizer(
    hf_tokenizer_dir: Path,
    *,
    chat_template: str | None = None,
    end_of_turn: Sequence[str] = (),
    stop_token_ids: Sequence[int] | None = None,
    bos_prefix: bool = False,
    approximate_ignore_merges: bool = False,
) -> MnnTokenizerFile:
    """Convert `hf_tokenizer_dir/tokenizer.json` into MNN 3.6.1's pipeline tokenizer file.

    `chat_template` is stored in the file (an llm_config.json `jinja.chat_template` overrides it).
    Stop ids are the eos token, the ids in generation_config.json's `eos_token_id`, the family's
    `end_of_turn` tokens that the tokenizer has, and `stop_token_ids`. See the module docstring
    for `bos_prefix`. `approximate_ignore_merges` writes an `ignore_merges` vocabulary whose
    whole-word-only words the runtime cannot reach, and measures the difference (logged, and
    returned as `ignore_merges_difference`). Raises ValueError, naming the file, for tokenizer features the runtime
    cannot reproduce (for example a Unigram or WordPiece model); inputs on which the runtime is
    known to differ are returned (and logged).
    """
    folder = Path(hf_tokenizer_dir)
    tj_path = folder / "tokenizer.json"
    tj = read_json(tj_path, TOKENIZER_LIMIT, "tokenizer file")
    tc_path = folder / "tokenizer_config.json"
    tc = read_optional_json(tc_path, TOKENIZER_LIMIT, "tokenizer config") or {}

    added = _check_added_tokens(tj.get("added_tokens", []), tj_path)
    if not isinstance(tj.get("model") or {}, dict):
        raise ValueError(f"{tj_path}: 'model' must be an object")
    body, specials = _encode_body(tj, tj_path, added, approximate_ignore_merges)

    content_to_id = {tok["content"]: tok["id"] for tok in added}
    vocab = (tj.get("model") or {}).get("vocab", {})

    def token_id(text: str) -> int | None:
        if text in content_to_id:
            return content_to_id[text]
        return vocab.get(text)

    bos_text = _token_text(tc.get("bos_token"))
    eos_text = _token_text(tc.get("eos_token"))
    specials.sort(key=lambda t: (-len(t["content"].encode("utf-8")), t["id"]))
    special_ids = _unique(t["id"] for t in specials)
    stop_ids = _stop_ids(folder, tc, token_id, end_of_turn, stop_token_ids or ())

    prefix_ids: list[int] = []
    if bos_prefix:
        bos_id = token_id(bos_text) if bos_text else None
        if bos_id is None:
            raise ValueError(f"{tc_path}: bos_prefix requested but no bos_token in the vocabulary")
        prefix_ids = [bos_id]

    header = (
        f"{MNN_TOKENIZER_MAGIC} {MNN_TOKENIZER_PIPELINE}\n"
        f"{len(special_ids)} {len(stop_ids)} {len(prefix_ids)}\n"
        + " ".join(str(i) for i in special_ids + stop_ids + prefix_ids)
        + "\n"
    ).encode("ascii")

    added_block = [u32(len(added))]
    for tok in added:
        added_block.append(
            u32(tok["id"])
            + u8(int(bool(tok.get("special"))))
            + u8(int(bool(tok.get("lstrip"))))
            + u8(int(bool(tok.get("rstrip"))))
            + string(tok["content"])
        )

    template = (chat_template or "").encode("utf-8")
    flags = 0x01 if tc.get("clean_up_tokenization_spaces") is True else 0
    trailer = u32(len(template)) + template + string(eos_text) + u8(flags) + string(bos_text)

    converted = MnnTokenizerFile(header + body.data + b"".join(added_block) + trailer, tuple(stop_ids),
                                 frozenset(body.unsafe_chars), tuple(dict.fromkeys(body.notes)), tuple(body.pieces),
                                 body.ignore_merges_difference)
    for note in converted.notes:
        log.warning("tokenizer: %s", note)
    if converted.unsafe_chars:
        log.info("tokenizer: MNN's regex matcher classifies %d rare character(s) differently from HF "
                 "(docs/supported-models.md)", len(converted.unsafe_chars))
    return converted
