"""Real English prose for training small models offline: a text file, or Jane Austen's novels.

Austen's six novels (public domain, about 4 MB of text) come from Debian's ``r-cran-janeaustenr``
package (the R package janeaustenr: Project Gutenberg's texts without their boilerplate, one line
per printed line). ``apt-get download`` fetches the .deb from the configured Debian mirror; the
texts are read out of it here (the .deb's ar archive, its data tarball, R's lazy-load data base:
llmexport/tiny/rdata.py) and cached as plain text. Nothing is installed.

The split is by book: *Persuasion* is held out for evaluation, the other five are for training,
so held-out scores measure text the model never saw.
"""

from __future__ import annotations

import io
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from llmexport.tiny.rdata import RDataError, read_character_vector, read_rdb_records

AUSTEN_PACKAGE = "r-cran-janeaustenr"
_RDB_MEMBER = "usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"
AUSTEN_BOOKS = ("EMMA", "MANSFIELD PARK", "NORTHANGER ABBEY", "PERSUASION", "PRIDE AND PREJUDICE",
                "SENSE AND SENSIBILITY")
AUSTEN_HELDOUT = "PERSUASION"


class CorpusError(ValueError):
    """A text source that cannot be used (missing, empty, unreadable); the message is one line."""


@dataclass(frozen=True)
class Corpus:
    """Training and held-out text (paragraphs separated by a newline) and where they came from."""

    train: str
    heldout: str
    source: str


def paragraphs(lines: Sequence[str | None]) -> str:
    """Hard-wrapped lines joined into paragraphs (empty lines separate them), one per line."""
    out: list[str] = []
    current: list[str] = []
    for line in [*lines, ""]:
        text = (line or "").strip()
        if text:
            current.append(text)
        elif current:
            out.append(" ".join(current))
            current = []
    return "\n".join(out)


def _checked_text(text: str, what: str) -> str:
    if not text.strip():
        raise CorpusError(f"{what}: no text in it")
    return text


def corpus_from_file(path: Path | str, heldout_fraction: float = 0.1) -> Corpus:
    """A UTF-8 text file; its last ``heldout_fraction`` of paragraphs is held out."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"{path}: no such text file")
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CorpusError(f"{path}: cannot read it as UTF-8 text ({exc.__class__.__name__})") from None
    text = paragraphs(_checked_text(raw, str(path)).splitlines()).splitlines()
    if len(text) < 2:
        raise CorpusError(f"{path}: needs at least two paragraphs (one to train on, one held out)")
    cut = min(len(text) - 1, max(1, round(len(text) * (1 - heldout_fraction))))
    return Corpus("\n".join(text[:cut]), "\n".join(text[cut:]), f"file {path.name}")


def _deb_member(deb: bytes, member: str) -> bytes:
    """One file of a .deb: an ar archive whose ``data.tar.*`` holds the package's files."""
    if not deb.startswith(b"!<arch>\n"):
        raise CorpusError("the downloaded .deb is not an ar archive")
    pos = 8
    while pos + 60 <= len(deb):
        name = deb[pos:pos + 16].decode().strip().rstrip("/")
        size = int(deb[pos + 48:pos + 58].decode().strip())
        body = deb[pos + 60:pos + 60 + size]
        pos += 60 + size + (size % 2)
        if name.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(body)) as tar:
                for info in tar.getmembers():
                    if info.name.lstrip("./") == member:
                        extracted = tar.extractfile(info)
                        if extracted is not None:
                            return extracted.read()
            raise CorpusError(f"the .deb has no {member}")
    raise CorpusError("the .deb has no data tarball")


def austen_books(deb: bytes) -> dict[str, str]:
    """Austen's novels as paragraph text, keyed by title, from the janeaustenr .deb's bytes."""
    try:
        records = read_rdb_records(_deb_member(deb, _RDB_MEMBER))
        books = [read_character_vector(r) for r in records]
    except (RDataError, tarfile.TarError) as exc:
        raise CorpusError(f"{AUSTEN_PACKAGE}: cannot read its data ({exc})") from None
    titled = {next((line or "").strip().upper() for line in book if (line or "").strip()): paragraphs(book)
              for book in books if any(book)}
    if set(titled) != set(AUSTEN_BOOKS):
        raise CorpusError(f"{AUSTEN_PACKAGE}: expected the books {AUSTEN_BOOKS}, found {sorted(titled)}")
    return titled


def _download_deb(package: str, into: Path) -> bytes:
    try:
        proc = subprocess.run(["apt-get", "download", package], cwd=into, capture_output=True, text=True,
                              timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CorpusError(f"apt-get download {package} failed ({exc.__class__.__name__}); give a text file "
                          "instead") from None
    debs = sorted(into.glob(f"{package}_*.deb"))
    if proc.returncode != 0 or not debs:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise CorpusError(f"apt-get download {package} failed: {last}; give a text file instead")
    return debs[-1].read_bytes()


def austen_corpus(cache_dir: Path) -> Corpus:
    """Austen's novels, fetched once into ``cache_dir/austen`` (train: five novels; held out:
    *Persuasion*)."""
    folder = Path(cache_dir) / "austen"
    train, heldout = folder / "train.txt", folder / "heldout.txt"
    if not (train.is_file() and heldout.is_file()):
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            books = austen_books(_download_deb(AUSTEN_PACKAGE, Path(tmp)))
        for path, text in ((train, "\n".join(books[t] for t in AUSTEN_BOOKS if t != AUSTEN_HELDOUT)),
                           (heldout, books[AUSTEN_HELDOUT])):
            part = path.with_suffix(".part")
            part.write_text(text, encoding="utf-8")
            part.replace(path)
    return Corpus(train.read_text(encoding="utf-8"), heldout.read_text(encoding="utf-8"),
                  f"Jane Austen's novels (Debian {AUSTEN_PACKAGE}); held out: Persuasion")
