"""``--path model.gguf``: the file seen as an HF folder.

Everything the export reads beside the weights comes from the file's metadata and is written once
into a folder of the cache (``$LLMEXPORT_GGUF_CACHE``, else ``~/.cache/llmexport/gguf``), keyed by
the file's absolute path, size and modification time: ``config.json`` (llmexport.source.importers.
gguf.config), ``tokenizer.json`` / ``tokenizer_config.json`` with the chat template and
``generation_config.json`` with llama.cpp's stop ids (.tokenizer), and ``model.gguf``, a link to the
file, from which the weights are read (``GgufWeights``). That folder is itself a valid ``--path``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from llmexport.errors import InputError
from llmexport.source.importers.gguf.config import hf_config
from llmexport.source.importers.gguf.file import GgufFile
from llmexport.source.importers.gguf.metadata import Metadata
from llmexport.source.importers.gguf.tokenizer import stop_ids, tokenizer_config, tokenizer_json

#: the link to the GGUF file inside a materialized folder
GGUF_LINK = "model.gguf"


def cache_root() -> Path:
    root = os.environ.get("LLMEXPORT_GGUF_CACHE") or str(Path.home() / ".cache" / "llmexport" / "gguf")
    return Path(root).expanduser()


def gguf_file_of(path: Path) -> Path | None:
    """The GGUF file ``--path`` names: the file itself, or the one ``*.gguf`` of a folder that has no
    config.json; None for anything else (an HF folder)."""
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise InputError(f"{path}: holds {len(found)} GGUF files ({', '.join(f.name for f in found[:3])}); "
                         "pass the one to export as --path")
    return found[0] if found else None


def read_config(file: GgufFile) -> dict[str, Any]:
    """The HF config of an opened GGUF file."""
    rope = file.tensors.get("rope_freqs.weight")
    shapes = {name: t.shape for name, t in file.tensors.items()}
    return hf_config(Metadata(file.metadata, str(file.path)), shapes, None if rope is None else rope.data)


def materialize(path: Path) -> Path:
    """The HF folder standing for the GGUF file ``path`` (written on first use)."""
    path = path.resolve()
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
