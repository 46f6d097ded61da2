"""``--path org/name``: a HuggingFace hub repo, fetched into huggingface_hub's cache and exported
from its snapshot folder.

Only what the export reads is downloaded (``READ_FILES`` and the safetensors weights; never a
pickle), in two steps: the small files first, then the shards the index names (or, without an
index, the top-level ``*.safetensors``), so a repo that also ships ``consolidated.safetensors``
or a ``original/`` copy costs nothing extra. huggingface_hub does the transfers: its cache
(``HF_HOME`` / ``HF_HUB_CACHE``), its token (``HF_TOKEN`` or ``hf auth login``), its offline mode
(``HF_HUB_OFFLINE``: a cached snapshot is used, nothing is asked of the network), its endpoint
(``HF_ENDPOINT``), its progress bars on a terminal, and its resumption of a transfer the network
cut (a Range request from the last whole chunk written, in the same run; files an earlier run
completed stay in the cache and are not fetched again, a partly written one starts over).

A local path always wins: an existing ``--path`` is a folder, whatever it looks like. Every
failure is an ``InputError`` naming the repo (or ``--revision``) and what was expected.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import struct
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from llmexport.errors import InputError, UsageError
from llmexport.progress import bars_wanted
from llmexport.source.importers.gguf import gguf_file_of, is_first_part, materialize, named_file, split_parts
from llmexport.source.input_files import CONFIG_LIMIT, INDEX_LIMIT, SAFETENSORS_HEADER_LIMIT, read_json

log = logging.getLogger(__name__)

#: ``org/name``: what the hub accepts (letters, digits, ``-``, ``_``, ``.``; at most 96 each side;
#: no ``--`` or ``..``; alphanumeric ends), so a typo'd local path is not sent to the network
_REPO_ID = re.compile(r"(?!.*(--|\.\.))[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9])?/[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9])?",
                      re.ASCII)

#: the small files the export (and --verify's HF reference and tokenizer) may read beside the
#: weights: llmexport.source.checkpoint, the families' chat templates, transformers' tokenizer and config
#: loaders (the processor configs are for towers' processors; a few KB). Exact top-level names,
#: never a pattern that could reach a pickle; no ``tokenizer.model``: tokenizer.json is required
#: and is what every reader here takes
READ_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
              "chat_template.json", "preprocessor_config.json", "processor_config.json")
#: weights llmexport refuses to load (arbitrary code on unpickling): named in the error of a repo
#: that has nothing else
PICKLES = ("*.bin", "*.pt", "*.pth", "*.pkl", "*.ckpt")


def is_repo_id(path: str) -> bool:
    """Whether ``path`` has the shape of a hub repo id (``org/name``)."""
    return _REPO_ID.fullmatch(path) is not None


@dataclass(frozen=True)
class ModelSource:
    """Where the checkpoint was read: a local ``folder``, or a hub ``repo_id`` at the ``revision``
    asked for, resolved to ``commit`` and cached in ``folder``."""

    folder: Path
    repo_id: str | None = None
    revision: str | None = None
    commit: str | None = None
    gguf_file: str | None = None  # the repo's GGUF file exported (``--gguf_file``)

    def manifest(self) -> dict[str, Any] | None:
        """manifest.json's ``source`` (hub repos only; a local folder's manifest stays as it was)."""
        if self.repo_id is None:
            return None
        source = {"repo_id": self.repo_id, "revision": self.revision or "main", "commit": self.commit}
        return source if self.gguf_file is None else {**source, "gguf_file": self.gguf_file}


def resolve_source(path: str | os.PathLike, revision: str | None = None, quiet: bool = False,
                   gguf_file: str | None = None) -> ModelSource:
    """The checkpoint ``path`` names: an existing folder as it is, else a hub repo id downloaded
    (or, offline, found) in huggingface_hub's cache. ``gguf_file`` (``--gguf_file``): the GGUF file
    of a folder or repo to export (of a repo, only that file, or the parts of a split one, is fetched)."""
    text = os.fspath(path)
    local = _local(text, revision, gguf_file)
    if local is not None:
        return local
    with _library_output(quiet), _hub_errors(text, revision):
        if gguf_file is not None:
            return _fetch_gguf(text, revision, gguf_file)
        snapshot = _small_files(text, revision)
        return _fetch_weights(snapshot)


@contextmanager
def planning_folder(path: str | os.PathLike, revision: str | None = None, quiet: bool = False,
                    gguf_file: str | None = None) -> Iterator[Path]:
    """The folder ``--dry-run`` plans from, without downloading weights: a local folder as it is; a
    hub repo's snapshot when its weights are cached; else a temporary folder holding the repo's
    small files and, in place of each weight file, its header (two Range requests) followed by a
    hole up to the file's size. The plan reads headers and sizes only (shapes, dtypes, the
    tiling check); the hole costs no disk where the file system keeps sparse files. A repo's GGUF
    file is fetched whole: its tensor table and metadata are what the plan reads."""
    text = os.fspath(path)
    local = _local(text, revision, gguf_file)
    if local is not None:
        yield local.folder
        return
    if gguf_file is not None:
        yield resolve_source(text, revision, quiet, gguf_file).folder
        return
    with _library_output(quiet), _hub_errors(text, revision):
        snapshot = _small_files(text, revision)
        absent = [name for name in snapshot.weights if not (snapshot.folder / name).exists()]
        headers = _remote_headers(snapshot, absent)
    if not headers:
        yield snapshot.folder
        return
    with tempfile.TemporaryDirectory(prefix="llmexport-plan-") as tmp:
        _stand_in(snapshot, Path(tmp), headers)
        yield Path(tmp)


def _local(path: str, revision: str | None, gguf_file: str | None = None) -> ModelSource | None:
    """``path`` as a local folder, or None when it names a hub repo (a missing path of another
    shape, or --revision with a folder, is an error)."""
    if not os.path.lexists(path) and is_repo_id(path):
        return None
    if revision is not None:
        raise UsageError(f"--revision {revision}: applies to a hub repo id; --path {path} is a local path")
    if not os.path.lexists(path):
        raise InputError(f"{path}: model path does not exist (nor is it a hub repo id such as org/name)")
    # a GGUF file: exported from its HF view (llmexport.source.importers.gguf)
    gguf = gguf_file_of(Path(path), gguf_file)
    return ModelSource(Path(path) if gguf is None else materialize(gguf))


def _fetch_gguf(repo_id: str, revision: str | None, name: str) -> ModelSource:
    """``--gguf_file name`` of a hub repo: that file (every part of a split model) fetched, nothing
    else (a repo of GGUF files holds a dozen quantizations of one model)."""
    from huggingface_hub import snapshot_download

    wanted = [glob.escape(part.as_posix()) for part in split_parts(Path(name))]
    folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=wanted))
    file = named_file(folder, name, f"--path {repo_id} (commit {folder.name})")
    log.info("%s: commit %s; %s", repo_id, folder.name, name)
    return ModelSource(materialize(file), repo_id, revision, folder.name, name)


@dataclass(frozen=True)
class _Snapshot:
    """A repo's small files in the cache, and the weight files its export reads."""

    repo_id: str
    revision: str | None
    folder: Path
    weights: list[str]
    indexed: bool

    @property
    def commit(self) -> str:
        return self.folder.name  # the snapshot folder is named by the commit it holds


def _small_files(repo_id: str, revision: str | None) -> _Snapshot:
    from huggingface_hub import snapshot_download

    folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(READ_FILES)))
    if not (folder / "config.json").exists():
        ggufs = _listed(repo_id, folder, ".gguf")
        if ggufs:
            raise InputError(f"--path {repo_id}: a repo of GGUF files ({', '.join(ggufs[:3])}"
                             f"{', ...' if len(ggufs) > 3 else ''}); name the one to export with --gguf_file")
        raise InputError(f"--path {repo_id}: the repo has no config.json at commit {folder.name} (expected a "
                         "transformers checkpoint)")
    shards = _indexed_shards(folder)
    weights = _top_level_safetensors(repo_id, folder.name, folder) if shards is None else shards
    log.info("%s: commit %s; %d safetensors file(s)%s", repo_id, folder.name, len(weights),
             "" if shards is None else " named by its index")
    return _Snapshot(repo_id, revision, folder, weights, shards is not None)


def _fetch_weights(snapshot: _Snapshot) -> ModelSource:
    from huggingface_hub import snapshot_download

    repo_id, folder, weights = snapshot.repo_id, snapshot.folder, snapshot.weights
    # the commit, not the branch: both steps read one snapshot even if the branch moves between them
    wanted = [*weights, *_remote_code(folder)]
    snapshot_download(repo_id, revision=snapshot.commit, allow_patterns=[glob.escape(name) for name in wanted])
    missing = [name for name in weights if not (folder / name).exists()]
    if missing:
        raise _not_in_repo(snapshot, missing)
    log.info("%s: %d files, %.1f MB, in %s", repo_id, len(os.listdir(folder)),
             sum(p.stat().st_size for p in folder.iterdir()) / 1e6, folder)
    return ModelSource(folder, repo_id, snapshot.revision, snapshot.commit)


def _not_in_repo(snapshot: _Snapshot, missing: list[str]) -> InputError:
    more = f" ({len(missing)} such files)" if len(missing) > 1 else ""
    named = ", named in model.safetensors.index.json," if snapshot.indexed else ""
    return InputError(f"--path {snapshot.repo_id}: {missing[0]}{named} is not in the repo at commit "
                      f"{snapshot.commit}{more}")


def _remote_code(folder: Path) -> list[str]:
    """The modules ``config.json``'s ``auto_map`` names (``configuration_x.XConfig`` ->
    ``configuration_x.py``): the reference model of a remote-code family (K2-Horizon) that
    ``--verify --trust_remote_code`` runs; small, and never run without that flag."""
    auto_map = read_json(folder / "config.json", CONFIG_LIMIT, "config").get("auto_map")
    entries = auto_map.values() if isinstance(auto_map, dict) else []
    names = [e for entry in entries for e in (entry if isinstance(entry, list) else [entry]) if isinstance(e, str)]
    # "module.Class" in this repo; "other/repo--module.Class" is code from another repo: not fetched
    return sorted({name.rsplit(".", 1)[0] + ".py" for name in names if "--" not in name and name.count(".") == 1})


def _remote_headers(snapshot: _Snapshot, names: list[str]) -> dict[str, tuple[bytes, int]]:
    """Each named weight file's header bytes (length prefix included) and its size, read with
    Range requests (what the hub's own safetensors metadata endpoint does)."""
    from huggingface_hub import constants, get_cached_repo_tree, hf_hub_url

    if names and constants.HF_HUB_OFFLINE:
        raise InputError(f"--path {snapshot.repo_id}: HF_HUB_OFFLINE is set and the cached snapshot in "
                         f"{snapshot.folder} lacks {names[0]} (--dry-run reads every weight file's header)")
    sizes = {f.path: f.size for f in get_cached_repo_tree(snapshot.repo_id, revision=snapshot.commit)}
    # only the repo's own paths: an index naming "../x" or "/x" is never requested nor written
    unknown = [name for name in names if name not in sizes]
    if unknown:
        raise _not_in_repo(snapshot, unknown)
    out = {}
    for name in names:
        url = hf_hub_url(snapshot.repo_id, name, revision=snapshot.commit)
        head = _byte_range(url, 0, 7)
        (length,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
        if not 0 <= length <= SAFETENSORS_HEADER_LIMIT or 8 + length > sizes[name]:
            raise InputError(f"--path {snapshot.repo_id}: {name} is not a safetensors file (header length {length})")
        out[name] = (head + _byte_range(url, 8, 7 + length), sizes[name])
    return out


def _byte_range(url: str, first: int, last: int) -> bytes:
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    response = get_session().get(url, headers={**build_hf_headers(), "Range": f"bytes={first}-{last}"})
    hf_raise_for_status(response)
    return response.content[: last - first + 1]  # a server that ignores Range sends it all


def _stand_in(snapshot: _Snapshot, folder: Path, headers: dict[str, tuple[bytes, int]]) -> None:
    """``folder`` as the snapshot would be: links to its small files (and cached weights), and each
    header of ``headers`` written and extended to the weight file's size with a hole."""
    present = [name for name in (*READ_FILES, *snapshot.weights) if name not in headers]
    for name in present:
        if (snapshot.folder / name).exists():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).symlink_to(snapshot.folder / name)
    for name, (header, size) in headers.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        with (folder / name).open("wb") as f:
            f.write(header)
            f.truncate(size)


def _indexed_shards(folder: Path) -> list[str] | None:
    """The shards the snapshot's index names (None without an index; the index itself is checked,
    its paths included, when the checkpoint is opened)."""
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        return None
    weight_map = read_json(index, INDEX_LIMIT, "safetensors index").get("weight_map")
    shards = sorted({v for v in weight_map.values() if isinstance(v, str)}) if isinstance(weight_map, dict) else []
    if not shards:
        raise InputError(f"{index}: malformed safetensors index ('weight_map' names no shard)")
    return shards


def _top_level_safetensors(repo_id: str, commit: str, folder: Path) -> list[str]:
    """The repo's top-level ``*.safetensors`` (what the export reads without an index), from the
    file list huggingface_hub cached with the snapshot; an error naming the pickles when there are none."""
    from fnmatch import fnmatch

    files = _repo_files(repo_id, folder)
    names = sorted(f for f in files if "/" not in f and f.endswith(".safetensors"))
    if names:
        return names
    pickles = sorted(f for f in files if any(fnmatch(f, p) for p in PICKLES))
    if pickles:
        raise InputError(f"--path {repo_id}: the repo has only pickle weights ({', '.join(pickles[:3])}); llmexport "
                         "reads *.safetensors and never unpickles (convert them to safetensors first)")
    raise InputError(f"--path {repo_id}: the repo (commit {commit}) has no *.safetensors weight files")


def _repo_files(repo_id: str, folder: Path) -> list[str]:
    """The repo's files at the snapshot's commit, from the list huggingface_hub cached with it."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        return [f.path for f in get_cached_repo_tree(repo_id, revision=folder.name)]
    except CachedRepoTreeNotFoundError:  # a snapshot cached without its list (older huggingface_hub): what it holds
        return [p.name for p in folder.iterdir()]


def _listed(repo_id: str, folder: Path, suffix: str) -> list[str]:
    """The repo's files ending in ``suffix`` (the first part only of a split GGUF model)."""
    return sorted(f for f in _repo_files(repo_id, folder) if f.lower().endswith(suffix) and is_first_part(Path(f)))


def _not_no_match(record: logging.LogRecord) -> bool:
    """huggingface_hub's warning that a pattern matched no file: a repo lacking an optional file
    (or, refused with our own message, a needed one) is no news."""
    return not record.getMessage().startswith("No files matched")


@contextmanager
def _library_output(quiet: bool) -> Iterator[None]:
    """huggingface_hub's bars where llmexport draws its own (a terminal or a notebook, not
    ``--quiet``); elsewhere (CI logs) they are off and our log lines remain. Its HTTP client's
    line per request and its no-match warning are left out."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    http_log, hub_log = logging.getLogger("httpx2"), logging.getLogger("huggingface_hub._snapshot_download")
    level = http_log.level
    http_log.setLevel(max(level, logging.WARNING))
    hub_log.addFilter(_not_no_match)
    switch_off = not bars_wanted(quiet) and not are_progress_bars_disabled()
    if switch_off:
        disable_progress_bars()
    try:
        yield
    finally:
        http_log.setLevel(level)
        hub_log.removeFilter(_not_no_match)
        if switch_off:
            enable_progress_bars()


@contextmanager
def _hub_errors(repo_id: str, revision: str | None) -> Iterator[None]:
    """huggingface_hub's exceptions as one-line ``InputError``s naming the repo and the remedy."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"--path {repo_id}"
    try:
        yield
    except GatedRepoError:
        raise InputError(f"{where}: gated repo on {constants.ENDPOINT}; accept its conditions on its page and set "
                         "HF_TOKEN (or run `hf auth login`) with a token that has access") from None
    except RepositoryNotFoundError:
        raise InputError(f"{where}: not a local folder, and no such model repo on {constants.ENDPOINT} (or it is "
                         "private: set HF_TOKEN to a token that can read it)") from None
    except RevisionNotFoundError:
        raise InputError(f"--revision {revision}: {repo_id} has no such branch, tag or commit") from None
    except RemoteEntryNotFoundError as exc:
        raise InputError(f"{where}: a file the repo lists is missing on the hub ({_url_of(exc)})") from None
    except LocalEntryNotFoundError as exc:
        raise InputError(_not_cached(where, revision, exc, constants.HF_HUB_OFFLINE, constants.HF_HUB_CACHE)) from None
    except HfHubHTTPError as exc:
        raise InputError(f"{where}: the hub answered {_first_line(exc)}") from None
    except OSError as exc:  # the network, a consistency check, the cache's disk
        raise InputError(f"{where}: download failed ({type(exc).__name__}: {_first_line(exc)})") from None
    except Exception as exc:
        import httpx2

        if isinstance(exc, httpx2.HTTPError):  # the connection dropped more often than huggingface_hub retries
            raise InputError(f"{where}: download failed ({type(exc).__name__}: {_first_line(exc)})") from None
        raise


def _not_cached(where: str, revision: str | None, exc: Exception, offline: bool, cache: str) -> str:
    at = f" at revision {revision}" if revision else ""
    if offline:
        return (f"{where}: HF_HUB_OFFLINE is set and no complete cached snapshot{at} is in {cache}; "
                "run once online (or unset HF_HUB_OFFLINE)")
    cause = exc.__cause__ or exc
    return (f"{where}: the hub cannot be reached ({type(cause).__name__}: {_first_line(cause)}) and no complete "
            f"cached snapshot{at} is in {cache}")


def _url_of(exc: Exception) -> str:
    response = getattr(exc, "response", None)
    return str(response.url) if response is not None else _first_line(exc)


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return " ".join(lines[:2]) if lines else type(exc).__name__
