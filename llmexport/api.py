"""Python API: ``export(path, dst, options)`` and ``verify(dst, path)``.

The export is built in a temporary folder beside ``dst`` and moved into place only when every
stage (and verification, if asked) succeeded, so ``dst`` never holds a half-written model.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmexport.errors import OutputError
from llmexport.options import ExportOptions

log = logging.getLogger(__name__)


@dataclass
class ExportResult:
    dst: Path
    files: list[str]
    plan: dict[str, Any]  # see llmexport.export_plan.export_plan
    timings: dict[str, float] = field(default_factory=dict)
    verification: dict[str, Any] | None = None


def export(path: str | os.PathLike, dst: str | os.PathLike, options: ExportOptions | None = None) -> ExportResult:
    """Export the HF checkpoint at ``path`` into the folder ``dst`` (replaced atomically)."""
    from llmexport.pipeline import run_export

    options = (options or ExportOptions()).validate()
    dst = Path(dst).absolute()
    staging = _staging_dir(dst)
    try:
        result = run_export(Path(path), staging, options)
        _replace(staging, dst)
        result.dst = dst
        return result
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def plan(path: str | os.PathLike, options: ExportOptions | None = None) -> dict[str, Any]:
    """What ``export`` would do (architecture, per-module schemes, estimated size); writes nothing."""
    from llmexport.pipeline import dry_run

    return dry_run(Path(path), (options or ExportOptions()).validate())


def verify(dst: str | os.PathLike, path: str | os.PathLike, **kwargs: Any) -> dict[str, Any]:
    """Run an exported folder in MNN's runtime beside the HF checkpoint it came from."""
    from llmexport.verify import verify_export

    return verify_export(Path(dst), Path(path), **kwargs)


def _staging_dir(dst: Path) -> Path:
    parent = dst.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".partial", dir=parent))
    except OSError as exc:
        raise OutputError(f"{dst}: cannot create the destination ({exc.strerror})") from None


def _replace(staging: Path, dst: Path) -> None:
    """Swap the finished export into ``dst``; an older export there is removed only afterwards."""
    old = None
    try:
        if dst.exists():
            if not dst.is_dir():
                raise OutputError(f"{dst}: exists and is not a folder")
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".old", dir=dst.parent))
            os.rename(dst, old / "previous")
        os.rename(staging, dst)
    except OSError as exc:
        if old is not None and (old / "previous").exists() and not dst.exists():
            os.rename(old / "previous", dst)
        raise OutputError(f"{dst}: cannot move the export into place ({exc.strerror})") from None
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
