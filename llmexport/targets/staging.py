"""The destination folder: refused when it would destroy the user's data, built beside itself,
swapped in crash-safely, and cleaned up after runs that died.

Every run owns three names beside ``dst`` that share a random token:

* ``.{dst}.llmexport-{token}.lock`` — created first and held with an exclusive ``flock`` for the
  whole run. The kernel drops the lock when the process dies, however it dies (SIGKILL
  included), so a later run can tell a dead owner from a live one without trusting pids.
* ``.{dst}.llmexport-{token}.partial`` — the export being built.
* ``.{dst}.llmexport-{token}.old`` — only where the OS cannot exchange two folders in one step:
  the previous export, between the two renames of the swap.

The swap is one ``renameat2(RENAME_EXCHANGE)`` on Linux (``renamex_np(RENAME_SWAP)`` on macOS):
``dst`` is at every instant either the old export or the new one. Elsewhere it is two renames,
and a run killed between them leaves ``dst`` missing and the old export in ``.old``; the next
run for the same ``dst`` puts it back. Each run first reaps the leftovers of dead runs for its
own ``dst`` (restores a stranded old export, removes partial and old folders), and only those.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import glob
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from llmexport.errors import OutputError, UsageError

log = logging.getLogger(__name__)

_TAG = "llmexport"
_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def resolve_destination(dst: str | os.PathLike, src: str | os.PathLike | None) -> Path:
    """The folder the export will replace (symlinks followed), refused before any work when
    replacing it could destroy the checkpoint or unrelated files (``src`` None: the checks that
    need no checkpoint, made before a hub repo is downloaded)."""
    real_dst = Path(os.path.realpath(dst))
    real_src = Path(os.path.realpath(src)) if src is not None else None
    if real_src is not None and (real_dst == real_src or real_dst in real_src.parents or real_src in real_dst.parents):
        raise UsageError(f"--dst_path {dst}: overlaps --path {src} (resolved: {real_dst} and {real_src}); "
                         "the export replaces --dst_path, so the two must be separate folders")
    cwd = Path(os.path.realpath(os.getcwd()))
    if real_dst == cwd or real_dst in cwd.parents:
        raise UsageError(f"--dst_path {dst}: is the current folder or one of its parents ({real_dst}); "
                         "the export would replace it")
    if real_dst == Path(os.path.realpath(Path.home())) or real_dst == Path(real_dst.anchor):
        raise UsageError(f"--dst_path {dst}: is the home or root folder ({real_dst}); the export would replace it")
    if os.path.lexists(real_dst) and not real_dst.is_dir():
        raise OutputError(f"{real_dst}: exists and is not a folder")
    return real_dst


class StagedExport:
    """``with StagedExport(dst) as staging: ...; staging.commit()`` — build in ``staging.path``;
    ``commit`` swaps it into ``dst``; leaving the block without commit removes everything this
    run created (the staging folder, its lock, and parent folders it had to make)."""

    def __init__(self, dst: Path):
        self.dst = dst
        token = secrets.token_hex(6)
        stem = f".{dst.name}.{_TAG}-{token}"
        self.lock_path = dst.parent / f"{stem}.lock"
        self.path = dst.parent / f"{stem}.partial"
        self.old = dst.parent / f"{stem}.old"
        self._lock_fd: int | None = None
        self._made_parents: list[Path] = []
        self.committed = False

    def __enter__(self) -> "StagedExport":
        try:
            self._made_parents = _make_parents(self.dst.parent)
            reap_stale(self.dst)
            self._lock_fd = _take_lock(self.lock_path, self.dst)
            os.mkdir(self.path)  # mode 0o777 less the umask, as for any folder the user makes
        except OSError as exc:
            self._cleanup()
            raise OutputError(f"{self.dst}: cannot create the destination ({exc.strerror or exc})") from None
        return self

    def commit(self) -> None:
        """Swap the finished export into ``dst``; the previous export there is removed after."""
        with _signals_deferred():
            try:
                replaced = _swap(self.path, self.dst, self.old)
            except OSError as exc:
                raise OutputError(f"{self.dst}: cannot move the export into place ({exc.strerror or exc})") from None
            self.committed = True
        for leftover in replaced:
            shutil.rmtree(leftover, ignore_errors=True)

    def __exit__(self, *exc_info) -> None:
        self._cleanup()

    def _cleanup(self) -> None:
        if not self.committed:
            shutil.rmtree(self.path, ignore_errors=True)
        if self._lock_fd is not None:
            _remove(self.lock_path)
            os.close(self._lock_fd)
            self._lock_fd = None
        if not self.committed:
            for folder in reversed(self._made_parents):  # deepest first; only if still empty
                try:
                    folder.rmdir()
                except OSError:
                    break


def _make_parents(parent: Path) -> list[Path]:
    """Create ``parent`` and its missing ancestors; returns the ones created, outermost first."""
    missing = []
    for folder in (parent, *parent.parents):
        if os.path.lexists(folder):
            break
        missing.append(folder)
    parent.mkdir(parents=True, exist_ok=True)
    return list(reversed(missing))


def _take_lock(path: Path, dst: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    owner = {"tool": _TAG, "pid": os.getpid(), "host": socket.gethostname(), "dst": str(dst)}
    os.write(fd, json.dumps(owner).encode())
    return fd


def _remove(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def reap_stale(dst: Path) -> list[Path]:
    """Clean what dead runs for ``dst`` left beside it; returns the folders removed or restored.

    A run is dead when its lock file can be locked; a live run's files are left alone. A previous
    export stranded between the two renames of a non-atomic swap is moved back to ``dst``.
    """
    done: list[Path] = []
    pattern = glob.escape(str(dst.parent / f".{dst.name}.{_TAG}-")) + "*.lock"
    for lock_path in map(Path, sorted(glob.glob(pattern))):
        try:
            fd = os.open(lock_path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner is alive
            if not _is_ours(fd):
                continue
            stem = lock_path.name[: -len(".lock")]
            old, partial = lock_path.with_name(stem + ".old"), lock_path.with_name(stem + ".partial")
            if old.is_dir() and not os.path.lexists(dst):
                os.rename(old, dst)
                log.warning("restored the previous export into %s (a run was killed while swapping)", dst)
                done.append(dst)
            for folder in (partial, old):
                if os.path.lexists(folder):
                    shutil.rmtree(folder, ignore_errors=True)
                    done.append(folder)
            _remove(lock_path)
        finally:
            os.close(fd)
    return done


def _is_ours(fd: int) -> bool:
    try:
        owner = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return False
    return isinstance(owner, dict) and owner.get("tool") == _TAG


def _swap(staging: Path, dst: Path, old: Path) -> list[Path]:
    """Put ``staging`` at ``dst``; returns the folders that now hold the previous export."""
    if not os.path.lexists(dst):
        os.rename(staging, dst)
        return []
    if _exchange(staging, dst):
        return [staging]  # the exchange left the previous export at the staging name
    os.rename(dst, old)
    try:
        os.rename(staging, dst)
    except OSError:
        os.rename(old, dst)
        raise
    return [old]


def _exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two paths; False where this OS or file system cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    if sys.platform.startswith("linux") and hasattr(libc, "renameat2"):
        at_fdcwd, rename_exchange = -100, 2
        result = libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    elif sys.platform == "darwin" and hasattr(libc, "renamex_np"):
        rename_swap = 2
        result = libc.renamex_np(os.fsencode(a), os.fsencode(b), rename_swap)
    else:
        return False
    if result == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP back while the swap runs (they arrive right after it)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
