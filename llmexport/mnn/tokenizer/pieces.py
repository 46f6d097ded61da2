"""How one piece decodes: in HF's decoder, and in MNN's single-id decode (``Llm::tokenizer_decode``).

The tokenizer writer (pipeline.py) asks it how an added token would stream and respells the row
where the runtime would differ; the stream model (stream.py) asks it what generation writes.
Both import it; it imports neither.
"""

from __future__ import annotations

import re
import string

from llmexport.mnn.tokenizer.byte_level import byte_level_chars

_META = "\u2581".encode("utf-8")
_HEX = frozenset(string.hexdigits.encode("ascii"))
_SPACES = frozenset(b" \t\n\v\f\r")
_BYTE_OF = {c: b for b, c in enumerate(byte_level_chars())}
_BYTE_OF_CHAR = {c.encode("utf-8"): b for c, b in _BYTE_OF.items()}


def _utf8_char_len(raw: bytes, i: int) -> int:
    """Bytes MNN's ``Unicode::utf8_decode`` consumes at ``raw[i]`` (1 for anything invalid)."""
    b0 = raw[i]
    n = 2 if b0 & 0xE0 == 0xC0 else 3 if b0 & 0xF0 == 0xE0 else 4 if b0 & 0xF8 == 0xF0 else 1
    if n == 1 or i + n > len(raw):
        return 1
    try:
        raw[i:i + n].decode("utf-8")
    except UnicodeDecodeError:
        return 1
    return n


def _scan_byte(raw: bytes, pos: int) -> int | None:
    """``sscanf(raw + pos, "<0x%02X>", &b)`` after ``raw[pos:pos+3] == b"<0x"``: the byte, or None."""
    i = pos + 3
    while i < len(raw) and raw[i] in _SPACES:  # %X skips white space first (not counted in the width)
        i += 1
    sign, width = 1, 2
    if i < len(raw) and raw[i] in b"+-":
        sign, width, i = (-1 if raw[i] == ord("-") else 1), 1, i + 1
    digits = raw[i:i + width]
    digits = digits[:next((k for k, c in enumerate(digits) if c not in _HEX), len(digits))]
    if not digits:
        return None
    return (sign * int(digits, 16)) & 0xFF


def runtime_piece_bytes(piece: str, *, byte_level: bool) -> bytes:
    """What ``Llm::tokenizer_decode`` streams for an id whose vocabulary piece is ``piece``.

    ``byte_level``: the tokenizer file's decoder holds ByteLevel. Pieces with a ``"<0x"`` that the
    runtime's ``stoi`` fix-up cannot parse (``"<0xZZ>"``) make the runtime throw; they are returned
    unchanged here.
    """
    raw = piece.encode("utf-8")
    out = bytearray()
    pos = 0
    while pos < len(raw):
        if raw[pos:pos + 3] == _META:
            out += b" "
            pos += 3
            continue
        if pos + 6 <= len(raw) and raw[pos:pos + 3] == b"<0x":
            byte = _scan_byte(raw, pos)
            if byte is not None:
                out.append(byte)
                pos += 6
                continue
        out.append(raw[pos])
        pos += 1
    word = bytes(out)
    if byte_level:
        mapped = bytearray()
        i = 0
        while i < len(word):
            n = _utf8_char_len(word, i)
            ch = word[i:i + n]
            if ch in _BYTE_OF_CHAR:
                mapped.append(_BYTE_OF_CHAR[ch])
            else:
                mapped += ch
            i += n
        word = bytes(mapped)
    if len(word) == 6 and word.startswith(b"<0x") and word.endswith(b">"):
        value = _stoi_hex(word[3:5])  # Llm::tokenizer_decode: std::stoi(word.substr(3, 2), nullptr, 16)
        if value is not None:
            word = bytes([value & 0xFF])
    return word


def _stoi_hex(two: bytes) -> int | None:
    m = re.match(rb"[ \t\n\v\f\r]*([+-]?)([0-9A-Fa-f]+)", two)
    if m is None:
        return None  # std::stoi throws: the runtime ends with an uncaught exception
    return -int(m.group(2), 16) if m.group(1) == b"-" else int(m.group(2), 16)


def flat_steps(decoder: dict | None) -> list[dict]:
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [step for child in decoder.get("decoders", []) for step in flat_steps(child)]
    return [decoder]


def hf_byte_piece(token: str) -> int | None:
    """HF's ByteFallback: a token of exactly 6 characters ``<0x..>`` whose two digits parse."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        if re.fullmatch(r"\+?[0-9A-Fa-f]{1,2}", token[3:5]):
            return int(token[3:5], 16)
    return None


def apply_strip(text: str, rule: tuple[str, int, int] | None) -> str:
    if rule is None:
        return text
    content, start, stop = rule
    cut = 0
    while cut < min(start, len(text)) and text[cut] == content:
        cut += 1
    end = len(text)
    while len(text) - end < stop and end > cut and text[end - 1] == content:
        end -= 1
    return text[cut:end]


def hf_piece_bytes(piece: str, decoder: dict | None) -> bytes | None:
    """The bytes HF's decoder makes of ``piece`` as one token among others: its per-token steps
    (Replace, ByteFallback, ByteLevel, a Strip before Fuse) up to the first step that joins tokens
    (Fuse, ByteLevel). None for decoders this does not model (Metaspace, WordPiece, regex Replace)."""
    token: str | bytes = piece
    for step in flat_steps(decoder):
        kind = step.get("type")
        if isinstance(token, bytes) or kind == "Fuse":
            break
        if kind == "Replace":
            pattern = step.get("pattern")
            if not isinstance(pattern, dict) or not isinstance(pattern.get("String"), str):
                return None
            token = token.replace(pattern["String"], str(step.get("content", "")))
        elif kind == "ByteFallback":
            byte = hf_byte_piece(token)
            if byte is not None:
                token = bytes([byte])
        elif kind == "ByteLevel":  # all characters in the byte map, or the token's own UTF-8
            token = (bytes(_BYTE_OF[c] for c in token) if all(c in _BYTE_OF for c in token)
                     else token.encode("utf-8"))
            break
        elif kind == "Strip":
            rule = (str(step.get("content", " ")), int(step.get("start", 0)), int(step.get("stop", 0)))
            token = apply_strip(token, rule)
        else:
            return None
    return token if isinstance(token, bytes) else token.encode("utf-8")


def runtime_spelling(target: bytes, *, byte_level: bool) -> str | None:
    """A vocabulary row whose runtime single-id decode is exactly ``target``, or None.

    ByteLevel: the GPT-2 characters of the bytes; otherwise the text, with "▁" written as its
    three byte pieces (the runtime would stream it as a space) and undecodable bytes as byte
    pieces. A "<" that would start a "<0x" scan is written "<0x3C>".
    """
    if byte_level:
        table = byte_level_chars()
        chars = [table[b] for b in target]
    else:
        text = target.decode("utf-8", "surrogateescape")
        chars = []
        for c in text:
            if c == "\u2581":
                chars.append("<0xE2><0x96><0x81>")
            elif 0xDC80 <= ord(c) <= 0xDCFF:
                chars.append(f"<0x{ord(c) - 0xDC00:02X}>")
            else:
                chars.append(c)
    out = ["<0x3C>" if c == "<" and "".join(chars[k + 1:k + 3]).startswith("0x") else c for k, c in enumerate(chars)]
    spelled = "".join(out)
    return spelled if runtime_piece_bytes(spelled, byte_level=byte_level) == target else None


def decoder_has_byte_level(node: dict | None) -> bool:
    """The decoder holds ByteLevel: the runtime's single-id decode then maps byte characters."""
    if not node:
        return False
    if node.get("type") == "Sequence":
        return any(decoder_has_byte_level(c) for c in node.get("decoders", []))
    return node.get("type") == "ByteLevel"
