"""Character vectors out of an R package's lazy-load data base (``data/Rdata.rdb`` + ``.rdx``).

R stores a package's data sets as records, each a 4-byte big-endian length followed by a zlib
stream of R's XDR serialization (format versions 2 and 3). Only what a text corpus needs is read:
records holding one character vector (``STRSXP`` of ``CHARSXP`` strings). The names of the
records come from the index (``.rdx``: a gzip'ed serialized list whose ``variables`` entry is a
named list of ``[offset, length]`` pairs); here records are simply read in file order, and the
caller names them, which keeps this reader to the two object types it needs.
"""

from __future__ import annotations

import struct
import zlib

_STRSXP = 16
_CHARSXP = 9
_NA_LENGTH = -1


class RDataError(ValueError):
    """The bytes are not what this reader understands."""


def _int(data: bytes, pos: int) -> tuple[int, int]:
    if pos + 4 > len(data):
        raise RDataError("truncated R serialization")
    return struct.unpack_from(">i", data, pos)[0], pos + 4


def read_character_vector(blob: bytes) -> list[str | None]:
    """One serialized R character vector (``NA`` entries as None)."""
    if not blob.startswith(b"X\n"):
        raise RDataError("not an R XDR serialization (no 'X\\n' header)")
    version, pos = _int(blob, 2)
    pos += 8  # the writer's R version, the oldest R version that reads it
    if version == 3:
        length, pos = _int(blob, pos)
        pos += length  # native encoding name
    elif version != 2:
        raise RDataError(f"R serialization format {version} (expected 2 or 3)")
    flags, pos = _int(blob, pos)
    if flags & 0xFF != _STRSXP:
        raise RDataError(f"R object of type {flags & 0xFF} (expected a character vector, {_STRSXP})")
    count, pos = _int(blob, pos)
    strings: list[str | None] = []
    for _ in range(count):
        flags, pos = _int(blob, pos)
        if flags & 0xFF != _CHARSXP:
            raise RDataError(f"character vector entry of type {flags & 0xFF}")
        length, pos = _int(blob, pos)
        if length == _NA_LENGTH:
            strings.append(None)
            continue
        if pos + length > len(blob):
            raise RDataError("truncated R string")
        strings.append(blob[pos:pos + length].decode("utf-8", errors="replace"))
        pos += length
    return strings


def read_rdb_records(rdb: bytes) -> list[bytes]:
    """The decompressed records of a lazy-load data base, in file order."""
    records, pos = [], 0
    while pos < len(rdb):
        size, pos = _int(rdb, pos)
        stream = zlib.decompressobj()
        try:
            record = stream.decompress(rdb[pos:])
        except zlib.error as exc:
            raise RDataError(f"record at byte {pos - 4}: {exc}") from None
        if len(record) != size or not stream.eof:
            raise RDataError(f"record at byte {pos - 4}: {len(record)} bytes, the header says {size}")
        pos = len(rdb) - len(stream.unused_data)
        records.append(record)
    return records


def write_rdb_record(strings: list[str]) -> bytes:
    """One record holding ``strings`` as R writes it (format 3): for tests of the reader."""
    body = b"X\n" + struct.pack(">iii", 3, 0x040201, 0x030500) + struct.pack(">i", 5) + b"UTF-8"
    body += struct.pack(">ii", _STRSXP, len(strings))
    for s in strings:
        raw = s.encode()
        body += struct.pack(">ii", 0x40000 | _CHARSXP, len(raw)) + raw
    return struct.pack(">i", len(body)) + zlib.compress(body)
