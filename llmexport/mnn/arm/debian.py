"""Debian's arm64 packages, fetched without apt, dpkg or root: the interpreter MNN's aarch64 wheel runs in.

``fetch_root`` downloads the suite's ``Release`` file (its signature checked with ``gpgv`` against
Debian's archive keyring when both are on this machine), the arm64 ``Packages.xz`` index (its SHA256
checked against ``Release``), resolves the ``Depends``/``Pre-Depends`` closure of the root packages
(the first alternative of a choice that the index holds, virtual names through ``Provides``;
version constraints are not evaluated: the suite holds one version of each package), downloads each
``.deb`` (SHA256 checked against the index) and unpacks its ``data.tar.*`` into one folder, as
``dpkg-deb -x`` would. Maintainer scripts never run. Absolute symlinks are rewritten relative to
the folder, so that the tree is self-contained for ``QEMU_LD_PREFIX``; no member may leave it.
"""

from __future__ import annotations

import hashlib
import io
import lzma
import os
import posixpath
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable, Iterable

from llmexport.errors import ConversionError

MIRROR = "https://deb.debian.org/debian"
SUITE = "bookworm"
ARCH = "arm64"
KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
#: the interpreter (python3.11 and its standard library) and what MNN's .so files need beyond libc
#: (readelf -d on the wheel: libstdc++.so.6, libgcc_s.so.1; it carries its own libgomp)
ROOT_PACKAGES = ("python3.11-minimal", "libpython3.11-stdlib", "libstdc++6", "libgcc-s1")


class FetchError(ConversionError):
    """A package, index or wheel that could not be fetched, or that failed its check."""


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    filename: str  # the .deb's path under the mirror
    sha256: str
    depends: tuple[tuple[str, ...], ...]  # each group: alternatives, the first that exists is taken
    provides: tuple[str, ...]


def _names(field: str) -> tuple[tuple[str, ...], ...]:
    """``a (>= 1), b:any | c`` -> ((a,), (b, c)): names only (arch qualifiers and versions dropped)."""
    groups = []
    for group in filter(None, (g.strip() for g in field.split(","))):
        alternatives = [alt.split("(")[0].strip().split(":")[0] for alt in group.split("|")]
        groups.append(tuple(a for a in alternatives if a))
    return tuple(g for g in groups if g)


def _stanzas(text: str) -> Iterable[dict[str, str]]:
    fields: dict[str, str] = {}
    key = ""
    for line in text.splitlines():
        if not line.strip():
            if fields:
                yield fields
            fields, key = {}, ""
        elif line[0] in " \t":
            if key:
                fields[key] += "\n" + line.strip()
        else:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    if fields:
        yield fields


def parse_packages(text: str) -> dict[str, Package]:
    """A ``Packages`` index: name -> package."""
    index = {}
    for fields in _stanzas(text):
        if not all(k in fields for k in ("Package", "Version", "Filename", "SHA256")):
            raise FetchError(f"Packages index: a stanza lacks Package/Version/Filename/SHA256: {sorted(fields)}")
        depends = _names(fields.get("Pre-Depends", "")) + _names(fields.get("Depends", ""))
        provides = tuple(name for group in _names(fields.get("Provides", "")) for name in group)
        index[fields["Package"]] = Package(fields["Package"], fields["Version"], fields["Filename"],
                                           fields["SHA256"], depends, provides)
    return index


def release_sha256(text: str) -> dict[str, tuple[str, int]]:
    """A ``Release`` file's SHA256 section: path -> (sha256, size)."""
    for fields in _stanzas(text):
        if "SHA256" in fields:
            entries = {}
            for line in fields["SHA256"].splitlines():
                parts = line.split()
                if len(parts) == 3:
                    entries[parts[2]] = (parts[0], int(parts[1]))
            return entries
    raise FetchError("Release file: no SHA256 section")


def closure(index: dict[str, Package], roots: Iterable[str]) -> list[Package]:
    """The packages ``roots`` need, themselves included, sorted by name. A dependency group none
    of whose names the index holds (as a package or through ``Provides``) is an error."""
    providers: dict[str, str] = {}
    for package in index.values():
        for name in package.provides:
            providers.setdefault(name, package.name)
    chosen: dict[str, Package] = {}
    todo: list[tuple[str, ...]] = [(root,) for root in roots]
    while todo:
        group = todo.pop()
        if any(n in chosen or providers.get(n) in chosen for n in group):
            continue
        pick = next((n for n in group if n in index), None) or next((providers[n] for n in group
                                                                      if n in providers), None)
        if pick is None:
            raise FetchError(f"Debian {SUITE}/{ARCH} holds none of {' | '.join(group)}")
        chosen[pick] = index[pick]
        todo.extend(index[pick].depends)
    return sorted(chosen.values(), key=lambda p: p.name)


def check_sha256(data: bytes, expected: str, what: str) -> None:
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected.lower():
        raise FetchError(f"{what}: SHA256 {actual} is not the expected {expected}; refused")


def _ar_members(data: bytes, what: str) -> dict[str, bytes]:
    """The members of an ``ar`` archive (the .deb container)."""
    if not data.startswith(b"!<arch>\n"):
        raise FetchError(f"{what}: not an ar archive (a .deb starts with '!<arch>')")
    members, offset = {}, 8
    while offset + 60 <= len(data):
        header = data[offset:offset + 60]
        name = header[:16].decode("ascii", "replace").strip().rstrip("/")
        try:
            size = int(header[48:58].decode("ascii").strip())
        except ValueError:
            raise FetchError(f"{what}: a corrupt ar member header at byte {offset}") from None
        start = offset + 60
        if header[58:60] != b"`\n" or start + size > len(data):
            raise FetchError(f"{what}: a corrupt ar member {name!r} at byte {offset}")
        members[name] = data[start:start + size]
        offset = start + size + (size % 2)
    return members


def _inside(root: Path, relative: PurePosixPath, what: str) -> Path:
    if relative.is_absolute() or ".." in relative.parts:
        raise FetchError(f"{what}: member {relative} leaves the folder; refused")
    target = root.joinpath(*relative.parts) if relative.parts else root
    parent = os.path.realpath(target.parent)
    if os.path.commonpath([parent, os.path.realpath(root)]) != os.path.realpath(root):
        raise FetchError(f"{what}: member {relative} goes through a link out of the folder; refused")
    return target


def _relative_link(member: PurePosixPath, target: str) -> str:
    """A symlink target as seen from inside the tree: an absolute one made relative to the member."""
    if not target.startswith("/"):
        return target
    return os.path.relpath(target.lstrip("/") or ".", str(member.parent) or ".")


def unpack_deb(data: bytes, dest: Path, what: str) -> None:
    """Unpack a .deb's ``data.tar.{xz,gz,bz2}`` (or plain ``data.tar``) into ``dest``."""
    members = _ar_members(data, what)
    names = [n for n in members if n.startswith("data.tar")]
    if len(names) != 1:
        raise FetchError(f"{what}: expected one data.tar member, found {sorted(members)}")
    if names[0] not in ("data.tar", "data.tar.xz", "data.tar.gz", "data.tar.bz2"):
        raise FetchError(f"{what}: {names[0]} is a compression this unpacker does not read")
    with tarfile.open(fileobj=io.BytesIO(members[names[0]]), mode="r:*") as tar:
        for info in tar:
            name = PurePosixPath(posixpath.normpath(info.name))
            if str(name) == ".":
                continue
            target = _inside(dest, name, what)
            if info.isdir():
                target.mkdir(parents=True, exist_ok=True)
            elif info.isfile():
                target.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(info)
                assert source is not None
                target.unlink(missing_ok=True)
                target.write_bytes(source.read())
                target.chmod(info.mode & 0o755 | 0o600)
            elif info.issym():
                link = _relative_link(name, info.linkname)
                if posixpath.normpath(posixpath.join(str(name.parent), link)).startswith(".."):
                    raise FetchError(f"{what}: link {name} -> {info.linkname} leaves the folder; refused")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.unlink(missing_ok=True)
                os.symlink(link, target)
            elif info.islnk():
                source_path = _inside(dest, PurePosixPath(posixpath.normpath(info.linkname)), what)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.unlink(missing_ok=True)
                shutil.copy2(source_path, target)
            # device nodes and fifos are not needed by an interpreter: skipped


def download(url: str, timeout: float = 120) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read()
    except OSError as exc:
        raise FetchError(f"cannot download {url}: {exc}") from None


def _signature_checked(release: bytes, signature: bytes) -> bool:
    """``gpgv`` on the Release file when it and Debian's keyring are here; a bad signature is refused."""
    gpgv = shutil.which("gpgv")
    if gpgv is None or not KEYRING.exists():
        return False
    with tempfile.TemporaryDirectory(prefix="llmexport-release-") as tmp:
        (Path(tmp) / "Release").write_bytes(release)
        (Path(tmp) / "Release.gpg").write_bytes(signature)
        proc = subprocess.run([gpgv, "--keyring", str(KEYRING), str(Path(tmp) / "Release.gpg"),
                               str(Path(tmp) / "Release")], capture_output=True, text=True)
    if proc.returncode != 0:
        raise FetchError(f"{MIRROR}/dists/{SUITE}/Release: its signature does not verify against {KEYRING}; refused")
    return True


def fetch_root(dest: Path, roots: Iterable[str] = ROOT_PACKAGES, fetch: Callable[[str], bytes] = download,
               log: Callable[[str], None] = print) -> dict[str, object]:
    """Unpack the closure of ``roots`` into ``dest``; returns what was fetched and checked (for the
    cache's manifest)."""
    base = f"{MIRROR}/dists/{SUITE}"
    release = fetch(f"{base}/Release")
    signed = _signature_checked(release, fetch(f"{base}/Release.gpg"))
    path = f"main/binary-{ARCH}/Packages.xz"
    expected = release_sha256(release.decode("utf-8", "replace")).get(path)
    if expected is None:
        raise FetchError(f"{base}/Release lists no {path}")
    packed = fetch(f"{base}/{path}")
    check_sha256(packed, expected[0], f"{base}/{path}")
    packages = closure(parse_packages(lzma.decompress(packed).decode("utf-8")), roots)
    log(f"arm64 runtime: {len(packages)} Debian {SUITE} packages "
        f"(Release signature {'verified with gpgv' if signed else 'NOT checked: gpgv or the keyring is missing'})")
    for package in packages:
        data = fetch(f"{MIRROR}/{package.filename}")
        check_sha256(data, package.sha256, package.filename)
        unpack_deb(data, dest, package.filename)
    return {"suite": SUITE, "release_signature_checked": signed,
            "packages": {p.name: p.version for p in packages}}
