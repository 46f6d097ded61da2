"""manifest.json's hashes taken while the files are written (llmexport/planning/digests.py)."""

from __future__ import annotations

import hashlib
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmexport.planning.digests import FileDigests, file_sha256


@settings(max_examples=40, deadline=None)
@given(parts=st.lists(st.binary(max_size=3000), max_size=12), big=st.integers(0, (1 << 21) + 17))
def test_written_digest_is_the_file_sha256(tmp_path_factory, parts, big):
    path = tmp_path_factory.mktemp("d") / "f.bin"
    digests = FileDigests()
    payload = parts + [os.urandom(big)]  # one write larger than the buffer goes straight through
    written = 0
    with digests.open(path) as f:
        for part in payload:
            assert f.write(part) == len(part)
            written += len(part)
            assert f.tell() == written
    expected = hashlib.sha256(b"".join(payload)).hexdigest()
    assert file_sha256(path) == expected
    assert digests.sha256(path) == expected
    assert digests._known[path.resolve()][1] == expected  # recorded while written, not hashed again


def test_a_file_changed_after_writing_is_hashed_from_disk(tmp_path):
    path = tmp_path / "f.bin"
    digests = FileDigests()
    with digests.open(path) as f:
        f.write(b"a" * 100)
    with open(path, "r+b") as g:  # same size, new content (and modification time)
        g.write(b"b")
    os.utime(path, ns=(0, 1))
    assert digests.sha256(path) == hashlib.sha256(b"b" + b"a" * 99).hexdigest()


def test_a_seek_voids_the_running_digest(tmp_path):
    path = tmp_path / "f.bin"
    digests = FileDigests()
    with digests.open(path) as f:
        f.write(b"x" * 10)
        f.seek(2)
        f.write(b"yy")
    assert path.resolve() not in digests._known
    assert digests.sha256(path) == hashlib.sha256(b"xxyy" + b"x" * 6).hexdigest()


def test_a_failed_write_records_nothing(tmp_path):
    path = tmp_path / "f.bin"
    digests = FileDigests()
    with pytest.raises(RuntimeError), digests.open(path) as f:
        f.write(b"partial")
        raise RuntimeError("disk full")
    assert path.resolve() not in digests._known
    assert digests.sha256(path) == hashlib.sha256(b"partial").hexdigest()
