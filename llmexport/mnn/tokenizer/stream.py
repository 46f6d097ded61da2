"""The text MNN 3.6.1's runtime streams for generated ids, and how it differs from HF's decode.

Read from MNN's sources (tag 3.6.1) and measured with the PyPI runtime (tests/test_tokenizer_streaming.py):

* ``ArGeneration::generate`` (speculative_decoding/generate.cpp; the lookahead, MTP, Eagle and
  DFlash strategies and ``Omni`` do the same) writes, for each sampled id,
  ``Llm::tokenizer_decode(id)`` to the output stream and flushes. A stop id (the header's stop list) writes ``end_with``
  instead (``"\\n"`` unless the caller gives one) and ends generation. Nothing else is written,
  and no state passes from one id to the next; ``context.generate_str`` is the same concatenation.
* ``Llm::tokenizer_decode`` (llm.cpp) is ``PipelineTokenizer::decode(int)`` (tokenizer.cpp), then
  a 6-byte result ``<0xHH>`` becomes that byte (``std::stoi``).
* ``PipelineTokenizer::decode(int)`` takes the id's row from the vocabulary table, replaces every
  ``"▁"`` by a space, replaces ``"<0x"`` + hex digits (``sscanf("<0x%02X>")``, 6 bytes consumed)
  by that byte anywhere in the row, and, when the file's decoder holds ByteLevel (decoder type 0),
  maps GPT-2 byte characters back to bytes. The decoder chain of the file (Replace, ByteFallback,
  Fuse, Strip) does not run, special ids are not skipped, clean_up_tokenization_spaces is not
  applied: they act only in ``decode(vector)``, which the engine never calls.
* Python binding (pymnn ``llm.h``): ``tokenizer_decode``/``response`` return the C string through
  ``PyUnicode_FromString``: cut at a NUL byte, ``UnicodeDecodeError`` on invalid UTF-8 (its
  ``.object`` holds the bytes); ``get_context()`` crashes when ``generate_str`` is not valid UTF-8.
  ``response(text, stream=True)`` writes the raw bytes to the process's stdout.

So the stream is HF's ``decode(ids, skip_special_tokens=False)`` of the ids before the first stop
id, except for these known differences (``streamed_text_difference`` names them, and
``StreamModel.hf_like_text`` predicts HF's text from them exactly):

* ``leading_strip``: HF's decoder ends with ``Strip`` after Fuse (Llama-2, Phi-3, Mistral-style
  SentencePiece vocabularies: ``Strip(" ", 1, 0)``) and drops the first space of the decoded text,
  the ``▁`` of the answer's first piece (or a first ``<0x20>``); the runtime streams it. No
  tokenizer file can express this: single-id decode is stateless, and the same row must keep its
  space everywhere but at the start.
* ``invalid_utf8``: the streamed bytes are not valid UTF-8 (a character split over byte ids that
  does not complete, a stray byte). HF writes U+FFFD (ByteFallback: one per byte piece of the
  invalid run; ByteLevel: per invalid sequence); the runtime writes the raw bytes. A character
  split over several ids that completes streams correctly.
* ``special_tokens``: ``skip_special_tokens=True`` drops special tokens that the runtime streams
  as text (only stop ids are withheld).
* ``piece_text``: a row whose single-id decode differs from HF's decoder on that token. The writer
  respells the rows of added tokens that BPE cannot reach, listed in the model vocabulary or not,
  so that this does not happen for them (pipeline.py; e.g. ``<｜fim▁hole｜>`` or
  DeepSeek's ``<｜begin▁of▁sentence｜>`` in a ByteLevel vocabulary, which HF keeps verbatim), except
  for one whose HF text is exactly ``<0xHH>`` (the ``std::stoi`` step turns any such result into a
  byte) and one BPE reaches (a merge's part or result, a character it looks up). Other model pieces
  are never respelled (BPE reaches them by their text); none of the real vocabularies checked has a
  model piece with ``"▁"`` or ``"<0x"`` that HF decodes otherwise. ``StreamModel.piece_text_ids``
  lists the ids concerned.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from llmexport.mnn.runtime import common_prefix_length
from llmexport.mnn.tokenizer.pieces import (
    apply_strip,
    decoder_has_byte_level,
    flat_steps,
    hf_byte_piece,
    hf_piece_bytes,
    runtime_piece_bytes,
)

__all__ = ["StreamModel", "StreamDifference", "hf_strip_rule", "streamed_text_difference", "DIFFERENCE_KINDS"]

DIFFERENCE_KINDS = ("leading_strip", "invalid_utf8", "special_tokens", "piece_text", "unexplained")

def hf_strip_rule(decoder: dict | None) -> tuple[str, int, int] | None:
    """``(content, start, stop)`` of the ``Strip`` HF's decoder applies to the whole decoded text
    (a Strip after the step that joins the tokens, as Llama-2's ``Strip(" ", 1, 0)`` after Fuse)."""
    steps = flat_steps(decoder)
    joined = False
    rule = None
    for step in steps:
        if step.get("type") in ("Fuse", "ByteLevel"):
            joined = True
        elif step.get("type") == "Strip" and joined:
            rule = (str(step.get("content", " ")), int(step.get("start", 0)), int(step.get("stop", 0)))
    return rule


@dataclass(frozen=True)
class StreamDifference:
    """How the runtime's stream differs from HF's decode of the same ids.

    ``kinds``: the known differences that account for it (a subset of ``DIFFERENCE_KINDS``, in
    that order), or ``("unexplained",)``; ``index``: the first differing character of HF's text;
    ``detail``: one readable line.
    """

    kinds: tuple[str, ...]
    index: int
    detail: str

    @property
    def explained(self) -> bool:
        return "unexplained" not in self.kinds


@dataclass(frozen=True)
class StreamModel:
    """The runtime's streaming of one exported tokenizer, computed in Python.

    ``pieces``: id -> the vocabulary row of the tokenizer file (what ``decode(int)`` starts from);
    ``hf_pieces``: id -> HF's token text (differs where the writer respelled an added token);
    ``byte_level``: the file's decoder holds ByteLevel; ``stop_ids``: the header's stop list;
    ``special_ids``: HF's special added tokens; ``decoder``: HF's decoder (tokenizer.json).
    """

    pieces: tuple[str, ...]
    hf_pieces: tuple[str, ...]
    byte_level: bool
    stop_ids: frozenset[int] = frozenset()
    special_ids: frozenset[int] = frozenset()
    decoder: dict | None = field(default=None, compare=False)

    @classmethod
    def from_tokenizer_json(cls, tj: dict, stop_ids: Iterable[int] = (),
                            pieces: Sequence[str] | None = None) -> StreamModel:
        """From a parsed ``tokenizer.json``; ``pieces``: the rows the writer wrote
        (``MnnTokenizerFile.pieces``), by default HF's tokens."""
        by_id = {i: p for p, i in (tj.get("model") or {}).get("vocab", {}).items()}
        for tok in tj.get("added_tokens", []):
            by_id[tok["id"]] = tok["content"]  # HF decodes an id through its added token first
        hf_pieces = tuple(by_id.get(i, "") for i in range(max(by_id, default=-1) + 1))
        decoder = tj.get("decoder")
        special = frozenset(t["id"] for t in tj.get("added_tokens", []) if t.get("special"))
        return cls(tuple(pieces) if pieces is not None else hf_pieces, hf_pieces, decoder_has_byte_level(decoder),
                   frozenset(stop_ids), special, decoder)

    @classmethod
    def from_folder(cls, hf_tokenizer_dir: Path | str, **convert_options) -> StreamModel:
        """For the tokenizer file our writer makes of ``hf_tokenizer_dir`` (``convert_options`` as
        for ``convert_tokenizer``)."""
        from llmexport.mnn.tokenizer.writer import convert_tokenizer

        converted = convert_tokenizer(Path(hf_tokenizer_dir), **convert_options)
        tj = json.loads((Path(hf_tokenizer_dir) / "tokenizer.json").read_text(encoding="utf-8"))
        return cls.from_tokenizer_json(tj, converted.stop_ids, converted.pieces)

    @property
    def strip(self) -> tuple[str, int, int] | None:
        """HF's whole-text Strip rule (``hf_strip_rule``), or None."""
        return hf_strip_rule(self.decoder)

    def piece_bytes(self, token_id: int) -> bytes:
        """``Llm::tokenizer_decode(token_id)``: the bytes generation streams for this id."""
        if not 0 <= token_id < len(self.pieces):
            return b""
        return runtime_piece_bytes(self.pieces[token_id], byte_level=self.byte_level)

    def streamed_ids(self, ids: Iterable[int]) -> list[int]:
        """The ids whose text generation streams: those before the first stop id."""
        out: list[int] = []
        for i in ids:
            if i in self.stop_ids:
                break
            out.append(i)
        return out

    def stream_bytes(self, ids: Iterable[int], end_with: bytes = b"\n") -> bytes:
        """What ``response()`` writes when the model generates ``ids``: the pieces of the ids before
        the first stop id, then ``end_with`` if a stop id came."""
        ids = list(ids)
        kept = self.streamed_ids(ids)
        return b"".join(self.piece_bytes(i) for i in kept) + (end_with if len(kept) < len(ids) else b"")

    @cached_property
    def _piece_text(self) -> frozenset[int]:
        out = set()
        for i in range(len(self.pieces)):
            want = self._hf_bytes(i)
            if want is not None and self.piece_bytes(i) != want:
                out.add(i)
        return frozenset(out)

    def piece_text_ids(self) -> list[int]:
        """Ids the runtime streams differently from HF's decoder on that one token
        (``hf_piece_bytes``): the ``piece_text`` difference."""
        return sorted(self._piece_text)

    def _hf_bytes(self, token_id: int) -> bytes | None:
        if token_id >= len(self.hf_pieces):
            return None
        return hf_piece_bytes(self.hf_pieces[token_id], self.decoder)

    def hf_like_text(self, ids: Iterable[int], *, skip_special_tokens: bool = False, strip: bool = True) -> str:
        """HF's decode of the ids generation streams (those before the first stop id), predicted
        piece by piece: U+FFFD where the bytes are not valid UTF-8, as HF writes it (ByteFallback:
        one per byte piece of an invalid run; ByteLevel: per invalid sequence), special ids dropped
        if asked, then HF's whole-text Strip (``strip=False`` leaves it out)."""
        kept = [i for i in self.streamed_ids(ids) if not (skip_special_tokens and i in self.special_ids)]
        data = [self._hf_bytes(i) for i in kept]
        chunks = [self.piece_bytes(i) if b is None else b for i, b in zip(kept, data)]
        fallback = any(s.get("type") == "ByteFallback" for s in flat_steps(self.decoder))
        if self.byte_level or not fallback:
            text = b"".join(chunks).decode("utf-8", "replace")
        else:
            parts: list[str] = []
            run: list[bytes] = []
            for i, chunk in zip(kept, chunks):
                if i < len(self.hf_pieces) and hf_byte_piece(self.hf_pieces[i]) is not None:
                    run.append(chunk)
                    continue
                parts.append(_run_text(run))
                run = []
                parts.append(chunk.decode("utf-8", "replace"))
            parts.append(_run_text(run))
            text = "".join(parts)
        return apply_strip(text, self.strip) if strip else text


def _run_text(run: list[bytes]) -> str:
    try:
        return b"".join(run).decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(run)


def streamed_text_difference(model: StreamModel, ids: Sequence[int], streamed: bytes | str, hf_text: str, *,
                             skip_special_tokens: bool = False) -> StreamDifference | None:
    """Compare what the runtime streamed for the generated ``ids`` with HF's decode of them.

    ``streamed``: the runtime's stream for ``ids`` (``response()``'s text or the concatenated
    ``tokenizer_decode`` of each id), without the ``end_with`` a stop id adds; ``hf_text``:
    ``tokenizer.decode(ids_before_the_first_stop_id, skip_special_tokens=...)``. Returns None when
    they are equal, otherwise the known differences that account for it (``StreamDifference``),
    or kinds ``("unexplained",)`` when the stream is not the runtime's decode of ``ids`` or no
    known difference explains HF's text.
    """
    raw = streamed.encode("utf-8") if isinstance(streamed, str) else bytes(streamed)
    kept = model.streamed_ids(ids)
    expected = b"".join(model.piece_bytes(i) for i in kept)
    shown = raw.decode("utf-8", "replace")
    if raw != expected:
        return StreamDifference(("unexplained",), common_prefix_length(shown, hf_text),
                                "the stream is not the runtime's decode of these ids (tokenizer_stream.StreamModel)")
    try:
        text = raw.decode("utf-8")
        invalid = False
    except UnicodeDecodeError:
        text, invalid = shown, True
    if not invalid and text == hf_text:
        return None
    specials = skip_special_tokens and any(i in model.special_ids for i in kept)
    for skip in ((False, True) if specials else (False,)):
        if model.hf_like_text(kept, skip_special_tokens=skip) != hf_text:
            continue
        plain = model.hf_like_text(kept, skip_special_tokens=skip, strip=False)
        kinds = [kind for kind, present in (
            ("leading_strip", apply_strip(plain, model.strip) != plain),
            ("invalid_utf8", invalid),
            ("special_tokens", skip),
            ("piece_text", any(i in model._piece_text for i in kept))) if present]
        if not kinds:  # HF's text is the prediction, but the stream differs from it otherwise
            break
        return StreamDifference(tuple(kinds), common_prefix_length(text, hf_text),
                                "; ".join(_DETAILS[k] for k in kinds))
    return StreamDifference(("unexplained",), common_prefix_length(text, hf_text),
                            "HF's text differs from the runtime's stream in a way no known difference explains")


_DETAILS = {
    "leading_strip": "HF's decoder strips the leading space (Strip after Fuse); the runtime streams each piece as is",
    "invalid_utf8": "the streamed bytes are not valid UTF-8; HF writes U+FFFD there",
    "special_tokens": "the runtime streams special tokens that skip_special_tokens drops",
    "piece_text": "a piece decodes differently on its own in the runtime than in HF's decoder",
}
