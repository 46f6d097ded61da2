"""GPT-2's byte -> character table, which HF's ByteLevel pre-tokenizer and MNN's runtime share."""

from __future__ import annotations


def byte_level_chars() -> list[str]:
    """GPT-2's byte -> character table (printable bytes keep their character, the rest move to
    U+0100 onwards), as HF's ByteLevel and MNN's ``create_bytes_char_map`` build it."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]
