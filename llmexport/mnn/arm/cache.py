"""The arm64 runtime's cached folder: Debian's interpreter (``root/``) and the wheels (``site/``).

Set up once from the package registries (``debian.fetch_root``, ``wheels.fetch_wheels``), in a
temporary folder beside the cache that is renamed into place only when complete (its
``manifest.json`` last), under an exclusive file lock: an interrupted set-up leaves no half cache,
and concurrent processes (pytest workers) wait for one set-up instead of racing. The folder's name
carries the suite and the wheels' versions, so changing a pin sets up a new one.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from llmexport.mnn.arm import debian, wheels

#: moves the cache (default ~/.cache/llmexport/arm64)
CACHE_ENV = "LLMEXPORT_ARM_CACHE"
LAYOUT = 1  # bump when what a set-up writes changes
MANIFEST = "manifest.json"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "llmexport" / "arm64")


def runtime_key() -> str:
    pins = "-".join(re.sub(r"[^A-Za-z0-9.]+", "", req.lower()) for req in wheels.WHEELS)
    return f"v{LAYOUT}-{debian.SUITE}-py{wheels.PYTHON_VERSION}-{pins}"


@dataclass(frozen=True)
class ArmRuntime:
    folder: Path

    @property
    def root(self) -> Path:  # QEMU_LD_PREFIX
        return self.folder / "root"

    @property
    def site(self) -> Path:  # PYTHONPATH: MNN and numpy
        return self.folder / "site"

    @property
    def python(self) -> Path:
        return self.root / "usr" / "bin" / f"python{wheels.PYTHON_VERSION}"

    def manifest(self) -> dict:
        return json.loads((self.folder / MANIFEST).read_text())


def _build(folder: Path, log: Callable[[str], None]) -> None:
    debs = debian.fetch_root(folder / "root", log=log)
    pins = wheels.fetch_wheels(folder / "site", log=log)
    (folder / MANIFEST).write_text(json.dumps({"debian": debs, "wheels": pins}, indent=2, sort_keys=True))


def ensure_runtime(log: Callable[[str], None] = print,
                   build: Callable[[Path, Callable[[str], None]], None] = _build) -> ArmRuntime:
    """The cached runtime, set up first when missing (``build`` fills a folder; tests pass their own)."""
    runtime = ArmRuntime(cache_dir() / runtime_key())
    if (runtime.folder / MANIFEST).exists():
        return runtime
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when the process dies
        if (runtime.folder / MANIFEST).exists():  # another process set it up meanwhile
            return runtime
        for stale in cache_dir().glob(".building-*"):  # left by an interrupted set-up (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(runtime.folder, ignore_errors=True)  # never complete without its manifest
        work = Path(tempfile.mkdtemp(prefix=".building-", dir=cache_dir()))
        try:
            log(f"arm64 runtime: setting up {runtime.folder} (once)")
            build(work, log)
            if not (work / MANIFEST).exists():
                raise debian.FetchError(f"the arm64 runtime's set-up wrote no {MANIFEST}")
            work.chmod(0o755)  # mkdtemp's 0700: the finished runtime is readable like any cache
            os.rename(work, runtime.folder)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    return runtime
