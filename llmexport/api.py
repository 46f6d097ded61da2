"""Python API: ``export(path, dst, options)``, ``plan(path, options)`` and ``verify(dst, path)``.

The export is built in a folder beside ``dst`` and swapped into place only when every stage (and
verification, if asked) succeeded, so ``dst`` never holds a half-written model (llmexport.targets.staging).
The results are typed (llmexport.results): ``ExportResult``, ``ExportPlan`` and ``VerifyReport``,
each with ``to_json()``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from llmexport.options import ExportOptions
from llmexport.results import ExportPlan, ExportResult, VerifyReport

__all__ = ["export", "plan", "verify", "ExportPlan", "ExportResult", "VerifyReport"]


def export(path: str | os.PathLike, dst: str | os.PathLike, options: ExportOptions | None = None) -> ExportResult:
    """Export the HF checkpoint at ``path`` into the folder ``dst`` (replaced atomically).

    ``path`` is a folder, or a hub repo id (``org/name``, at ``options.revision``) that is not an
    existing path: its safetensors, configs and tokenizer files are downloaded into huggingface_hub's
    cache first (llmexport.source.hub), and manifest.json records the repo and the commit.

    ``dst`` must not overlap ``path`` (nor be the current folder, one of its parents, the home or
    the root folder): that is refused before any work. The export is built beside ``dst`` and
    swapped in at the end; on any failure ``dst`` and its surroundings are left as they were.
    An export (or verification) whose expected peak memory exceeds the available memory (or
    ``options.max_memory``) raises ``ResourceError`` before any heavy stage. With ``verify`` and
    ``keep_failed``, a verification that disagrees does not raise: the export is kept and the
    result's ``verification.passed`` is False.
    """
    from llmexport.pipeline import run_export
    from llmexport.source.hub import resolve_source
    from llmexport.targets.staging import StagedExport, resolve_destination

    options = (options or ExportOptions()).validate()
    resolve_destination(dst, None)  # a destination refused for itself is refused before any download
    source = resolve_source(path, options.revision, options.quiet, options.gguf_file)
    target = resolve_destination(dst, source.folder)
    with StagedExport(target) as staging:
        result = run_export(source.folder, staging.path, options, source.manifest())
        staging.commit()
    return dataclasses.replace(result, dst=target)


def plan(path: str | os.PathLike, options: ExportOptions | None = None) -> ExportPlan:
    """What ``export`` would do (architecture, per-module schemes, exact size); writes nothing. For
    a hub repo id only the small files are downloaded (into huggingface_hub's cache) and each
    weight file's header is read with Range requests (llmexport.source.hub.planning_folder)."""
    from llmexport.pipeline import dry_run
    from llmexport.source.hub import planning_folder

    options = (options or ExportOptions()).validate()
    with planning_folder(path, options.revision, options.quiet, options.gguf_file) as folder:
        return dry_run(folder, options)


def verify(dst: str | os.PathLike, path: str | os.PathLike, revision: str | None = None,
           gguf_file: str | None = None, **kwargs: Any) -> VerifyReport:
    """Run an exported folder in MNN's runtime beside the HF checkpoint it came from; the report is
    also written to ``dst/verify.json`` (``path`` may be a hub repo id, at ``revision``;
    ``gguf_file``: the GGUF file of a folder or repo holding several;
    ``trust_remote_code=True`` is needed for families whose reference is the checkpoint's own code;
    ``verify_arm=True`` also runs the runtime side on MNN's ARM kernels, ``VerifyReport.arm``)."""
    from llmexport.mnn.arm.machine import arm_machine
    from llmexport.source.hub import resolve_source
    from llmexport.verification.verify import verify_export

    if kwargs.pop("verify_arm", False):
        kwargs["arm"] = arm_machine()
    return verify_export(Path(dst), resolve_source(path, revision, gguf_file=gguf_file).folder, **kwargs)
