"""``--path model.gguf`` (or a folder with ``--gguf_file``): the file seen as an HF folder.

Everything the export reads beside the weights comes from the file's metadata and is written once
into a folder of the cache (``$LLMEXPORT_GGUF_CACHE``, else ``~/.cache/llmexport/gguf``), keyed by
the file's absolute path, size and modification time: ``config.json`` (llmexport.source.importers.
gguf.config), ``tokenizer.json`` / ``tokenizer_config.json`` with the chat template and
``generation_config.json`` with llama.cpp's stop ids (.tokenizer), and ``model.gguf``, a link to the
file (the first part of a split model, whose other parts are found beside it), from which the
weights are read (``GgufWeights``). That folder is itself a valid ``--path``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from llmexport.errors import InputError, UsageError
from llmexport.source.importers.gguf.config import hf_config
from llmexport.source.importers.gguf.file import GgufFile, is_first_part
from llmexport.source.importers.gguf.metadata import Metadata
from llmexport.source.importers.gguf.names import NOT_TENSORS
from llmexport.source.importers.gguf.tokenizer import stop_ids, tokenizer_config, tokenizer_json

#: the link to the GGUF file inside a materialized folder
GGUF_LINK = "model.gguf"


def cache_root() -> Path:
    root = os.environ.get("LLMEXPORT_GGUF_CACHE") or str(Path.home() / ".cache" / "llmexport" / "gguf")
    return Path(root).expanduser()


def gguf_file_of(path: Path, name: str | None = None) -> Path | None:
    """The GGUF file ``--path`` names: the file itself; in a folder that has no config.json, the one
    ``*.gguf`` (the first part of one split model), or the one ``name`` (``--gguf_file``) names;
    None for anything else (an HF folder)."""
    if path.is_file():
        if name is not None:
            raise UsageError(f"--gguf_file {name}: names a file in a folder or hub repo; --path {path} is a file")
        return path if path.suffix.lower() == ".gguf" else None
    if name is not None:
        return named_file(path, name, f"--path {path}")
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(p for p in path.glob("*.gguf") if is_first_part(p))
    if len(found) > 1:
        raise InputError(f"{path}: holds {len(found)} GGUF models ({', '.join(f.name for f in found[:3])}); "
                         "name one with --gguf_file (or pass the file as --path)")
    return found[0] if found else None


def named_file(folder: Path, name: str, where: str) -> Path:
    """``--gguf_file name`` in ``folder`` (a local folder or a hub snapshot): a ``.gguf`` file there,
    else an error listing the GGUF files it has."""
    if not name.lower().endswith(".gguf") or Path(name).is_absolute() or ".." in Path(name).parts:
        raise UsageError(f"--gguf_file {name}: expected the name of a .gguf file inside the folder or repo")
    path = folder / name
    if not path.is_file():
        have = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.gguf") if is_first_part(p))
        listed = f"its GGUF files: {', '.join(have[:5])}" if have else "it has no .gguf file"
        raise InputError(f"{where}: no GGUF file {name} ({listed})")
    return path


def read_config(file: GgufFile) -> dict[str, Any]:
    """The HF config of an opened GGUF file."""
    shapes = {name: t.shape for name, t in file.tensors.items()}
    extras = {name: file.tensors[name].data for name in NOT_TENSORS if name in file.tensors}
    return hf_config(Metadata(file.metadata, str(file.path)), shapes, extras)


def materialize(path: Path) -> Path:
    """The HF folder standing for the GGUF file ``path`` (written on first use)."""
    path = Path(os.path.abspath(path))  # links kept: a split model's parts are found by the first one's name
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_root() / f"{path.stem}-{key}"
    if (folder / "config.json").exists():
        return folder
    file = GgufFile(path)
    where = str(path)
    config = read_config(file)
    stops = stop_ids(file.metadata, where)
    config["eos_token_id"] = stops or config["eos_token_id"]
    files = {"config.json": config, "tokenizer.json": tokenizer_json(file.metadata, where),
             "tokenizer_config.json": tokenizer_config(file.metadata, where),
             "generation_config.json": {"bos_token_id": config["bos_token_id"], "eos_token_id": stops,
                                        "do_sample": False}}
    staging = folder.with_name(folder.name + f".tmp{os.getpid()}")
    staging.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (staging / name).write_text(json.dumps(content, ensure_ascii=False, indent=1), encoding="utf-8")
    (staging / GGUF_LINK).symlink_to(path)
    try:
        staging.rename(folder)
    except OSError:  # another process wrote it first
        if not (folder / "config.json").exists():
            raise
    return folder
