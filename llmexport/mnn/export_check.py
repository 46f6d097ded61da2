"""Can MNN's LLM runtime run this folder? Checked from the files alone, before the runtime reads them.

MNN 3.6.1 trusts its files: ``DiskEmbedding`` seeks to ``row * row_bytes`` and reads whatever is
there (transformers/llm/engine/src/diskembedding.cpp), and a graph's external weights are read at
the offsets ``llm.mnn`` records. A truncated download then gives garbage or a crash instead of an
error. So every file the runtime will open is checked here against the extents that the graph
(``external = [offset, sizes...]`` of each op, read from the converter's JSON dump, as
readback.py does) and the table entries of the merged configuration promise.

The runtime merges ``config.json`` with ``llm_config.json`` (``LlmConfig``, llmconfig.hpp: the
model description overrides) and resolves every file name against the folder; so does this module.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmexport.errors import ConversionError, InputError, UsageError
from llmexport.mnn.convert import run_converter
from llmexport.source.input_files import check_regular, read_json

#: the file names the runtime uses when config.json names none (LlmConfig's defaults)
DEFAULT_FILES = {"llm_config": "llm_config.json", "llm_model": "llm.mnn", "llm_weight": "llm.mnn.weight",
                 "embedding_file": "embeddings_bf16.bin", "tokenizer_file": "tokenizer.txt",
                 "visual_model": "visual.mnn", "audio_model": "audio.mnn"}
DEFAULT_MAX_NEW_TOKENS = 512  # LlmConfig::max_new_tokens

# What MNN 3.6.1 decodes: images through stb_image built with JPEG, PNG and BMP only
# (tools/cv/source/imgcodecs/imgcodecs.cpp), audio through a RIFF/WAVE reader (tools/audio/source/audio.cpp).
#: the largest image (pixels) the runtime is given: it decodes the whole file before resizing
MAX_IMAGE_PIXELS = 64_000_000
_IMAGE_MAGIC = {b"\xff\xd8\xff": "JPEG", b"\x89PNG\r\n\x1a\n": "PNG", b"BM": "BMP"}
#: media tags as the runtime finds them in a prompt (Omni::tokenizer_encode)
MEDIA_TAG = re.compile(r"<(img|audio)>(.*?)</\1>")
_HW_TAG = re.compile(r"<hw>.*?</hw>")


@dataclass(frozen=True)
class RunnableExport:
    """What the chat needs to know about a checked folder."""

    folder: Path
    config_path: Path
    model_type: str
    context: int | None  # max_position_embeddings; None when the export declares none
    max_new_tokens: int
    visual: bool
    audio: bool
    has_template: bool


def check_export(folder: Path) -> RunnableExport:
    """Raise InputError (one line, naming the file) unless the runtime can load ``folder``."""
    if not folder.exists():
        raise InputError(f"{folder}: no such folder")
    if not folder.is_dir():
        raise InputError(f"{folder}: not a folder (give the folder an export wrote)")
    config_path = folder / "config.json"
    if not os.path.lexists(config_path):
        raise InputError(f"{folder}: not an MNN export (no config.json)")
    runtime = read_json(config_path, what="runtime config")
    model = _read_model_config(folder, runtime)
    merged = {**runtime, **model}
    graph = _file(folder, merged, "llm_model", "graph", missing="not an MNN export (no {name})")
    weight = _file(folder, merged, "llm_weight", "weight file")
    _file(folder, merged, "tokenizer_file", "tokenizer")
    visual, audio = bool(merged.get("is_visual")), bool(merged.get("is_audio"))
    towers = [_file(folder, merged, key, "tower graph") for enabled, key in
              ((visual, "visual_model"), (audio, "audio_model")) if enabled]
    _verify_graphs([graph, *towers])
    records = _graph_records(graph)
    _check_extents(graph, weight, records)
    _check_tables(folder, merged, weight, records)
    for tower in towers:  # the runtime loads a tower with its default external file, NAME.weight
        _check_extents(tower, tower.with_name(tower.name + ".weight"), _graph_records(tower))
    return RunnableExport(folder, config_path, str(merged.get("model_type", "?")), _context(merged, model),
                          _positive(merged.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS), DEFAULT_MAX_NEW_TOKENS),
                          visual, audio, bool((merged.get("jinja") or {}).get("chat_template")))


def _read_model_config(folder: Path, runtime: dict[str, Any]) -> dict[str, Any]:
    name = runtime.get("llm_config", DEFAULT_FILES["llm_config"])
    path = folder / str(name)
    if not os.path.lexists(path):
        raise InputError(f"{folder}: not an MNN export (no {name})")
    return read_json(path, what="model config")


def _file(folder: Path, merged: dict[str, Any], key: str, what: str, missing: str = "") -> Path:
    name = merged.get(key, DEFAULT_FILES.get(key))
    if not isinstance(name, str) or not name:
        raise InputError(f"{folder}: '{key}' must name a file, found {name!r}")
    path = folder / name
    if missing and not os.path.lexists(path):
        raise InputError(f"{folder}: " + missing.format(name=name))
    check_regular(path, what)
    return path


# MNN's Interpreter runs the flatbuffers verifier over the whole graph file (the converter's JSON dump
# does not: it reads a truncated file as a graph with fewer ops, or none). One child for all graphs,
# ended with os._exit; the marker keeps MNN's own stdout lines apart.
_VERIFY = ("import os, sys, MNN\n"
           "for i, path in enumerate(sys.argv[1:]):\n"
           "    try:\n"
           "        MNN.Interpreter(path)\n"
           "        print('LLMEXPORT-VERIFIED', i, flush=True)\n"
           "    except Exception:\n"
           "        pass\n"
           "os._exit(0)\n")


def _verify_graphs(graphs: list[Path]) -> None:
    proc = subprocess.run([sys.executable, "-c", _VERIFY, *map(str, graphs)], capture_output=True, text=True,
                          errors="replace", timeout=600)
    verified = {int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("LLMEXPORT-VERIFIED ")}
    for i, graph in enumerate(graphs):
        if i not in verified:
            raise InputError(f"{graph}: not a valid MNN graph (MNN's verifier refuses it: truncated or corrupt)")


@dataclass(frozen=True)
class _Record:
    external: list[int]  # [offset, sizes...]
    out_count: int  # a Convolution's outputCount (0 for other ops)


def _graph_records(graph: Path) -> dict[str, _Record]:
    """``external`` of every op of ``graph`` (MoE subgraphs included), by op name."""
    with tempfile.TemporaryDirectory(prefix="llmexport-check-") as tmp:
        dump = Path(tmp) / "graph.json"
        try:
            run_converter(["-f", "MNN", "--modelFile", str(graph), "--JsonFile", str(dump)], dump)
            data = json.loads(dump.read_text())
        except (ConversionError, ValueError):
            raise InputError(f"{graph}: not a valid MNN graph (MNN's converter cannot read it)") from None
    ops = list(data.get("oplists", [])) + [op for sub in data.get("subgraphs", []) for op in sub.get("nodes", [])]
    records = {}
    for index, op in enumerate(ops):
        main = op.get("main")
        if isinstance(main, dict) and main.get("external"):
            count = int(main.get("common", {}).get("outputCount", 0)) if op.get("type") == "Convolution" else 0
            records[str(op.get("name", index))] = _Record([int(v) for v in main["external"]], count)
    return records


def _extent(record: _Record) -> int:
    return record.external[0] + sum(record.external[1:]) if record.external else 0


def _check_extents(graph: Path, weight: Path, records: dict[str, _Record]) -> None:
    if not records:
        return
    name, need = max(((n, _extent(r)) for n, r in records.items()), key=lambda item: item[1])
    have = check_regular(weight, "weight file")
    if have < need:
        raise InputError(f"{weight}: {have} bytes, but {graph.name} reads up to byte {need} (op {name!r}); "
                         "the file is truncated or belongs to another export")


def _check_tables(folder: Path, merged: dict[str, Any], weight: Path, records: dict[str, _Record]) -> None:
    """The token table (and a separate PLE table) the runtime's DiskEmbedding reads."""
    width = _positive(merged.get("hidden_size"), 0)
    if not width:
        raise InputError(f"{folder}: llm_config.json has no positive 'hidden_size'")
    rows = _vocab_rows(records)
    tie = merged.get("tie_embeddings")
    if tie is not None:
        layout = _tie_layout(folder, tie)
        path = weight if layout[0] else _file(folder, merged, "embedding_file", "embedding table")
        _check_table(path, rows, width, *layout)
    else:
        _check_table(_file(folder, merged, "embedding_file", "embedding table"), rows, width, 0, 0, 0, 16)
    if "ple_embed_file" in merged:
        ple_path = _file(folder, merged, "ple_embed_file", "per-layer embedding table")
        ple_width = _positive(merged.get("ple_embed_dim"), 0)
        quant = merged.get("ple_quant") or []
        if isinstance(quant, list) and len(quant) >= 5:
            offset, alpha_offset, alpha_size, bits = (int(v) for v in quant[:4])
            _check_table(weight if offset else ple_path, rows, ple_width, offset, alpha_offset, alpha_size, bits)
        else:
            _check_table(ple_path, rows, ple_width, 0, 0, 0, 16)


def _vocab_rows(records: dict[str, _Record]) -> int | None:
    """Rows of the token table: the vocabulary, i.e. lm_head's output count (None when no op is
    named so; then only whole rows are checked)."""
    return next((r.out_count for name, r in records.items() if "lm_head" in name and r.out_count), None)


def _tie_layout(folder: Path, tie: Any) -> tuple[int, int, int, int]:
    """(weight offset, alpha offset, alpha bytes, bits) as LlmConfig::tie_embeddings_info reads them."""
    try:
        if isinstance(tie, list):
            return int(tie[0]), int(tie[1]), int(tie[2]), int(tie[3])
        return (int(tie.get("weight_offset", 0)), int(tie.get("alpha_offset", 0)), int(tie.get("alpha_size", 0)),
                int(tie.get("quant_bit", 0)))
    except (TypeError, ValueError, IndexError, AttributeError):
        raise InputError(f"{folder}: malformed 'tie_embeddings' in llm_config.json: {tie!r}") from None


def _check_table(path: Path, rows: int | None, width: int, offset: int, alpha_offset: int, alpha_size: int,
                 bits: int) -> None:
    have = check_regular(path, "table")
    if bits in (4, 8) and alpha_size:
        need = alpha_offset + alpha_size
        if have < need:
            raise InputError(f"{path}: {have} bytes, but the table's scales end at byte {need}; the file is truncated")
        return
    row_bytes = width * 2  # bf16 rows (or fp16 rows of a 16-bit lm_head record)
    if not row_bytes:
        return
    table = have - offset
    if rows is not None and table < rows * row_bytes:
        raise InputError(f"{path}: {have} bytes, {offset + rows * row_bytes} expected for {rows} rows of {width} "
                         "16-bit values; the file is truncated")
    if offset == 0 and (have == 0 or have % row_bytes):
        raise InputError(f"{path}: {have} bytes is not a whole number of rows of {width} 16-bit values; "
                         "the file is truncated or belongs to another export")


def _context(merged: dict[str, Any], model: dict[str, Any]) -> int | None:
    value = model.get("max_position_embeddings", merged.get("max_position_embeddings"))
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _positive(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def require_tower(export: RunnableExport, kind: str) -> None:
    """UsageError unless the export has the tower for ``kind`` ("image" or "audio")."""
    if not (export.visual if kind == "image" else export.audio):
        raise UsageError(f"{export.folder}: this export has no {kind} tower ({kind} input needs an export "
                         f"of a checkpoint with one)")


def check_media(text: str, export: RunnableExport) -> None:
    """Every ``<img>``/``<audio>`` tag in ``text`` names a file the runtime can decode, for a tower
    the export has (the runtime silently drops a file it cannot open). Raises UsageError. An export
    without towers runs as a plain ``Llm``, which reads tags as text: nothing to check then."""
    if not (export.visual or export.audio):
        return
    for kind, content in MEDIA_TAG.findall(text):
        label = "image" if kind == "img" else "audio"
        require_tower(export, label)
        path = Path(_HW_TAG.sub("", content) if kind == "img" else content)
        if not path.is_file():
            raise UsageError(f"{path}: no such {label} file")
        with open(path, "rb") as f:
            head = f.read(12)
        if kind == "img" and not any(head.startswith(magic) for magic in _IMAGE_MAGIC):
            raise UsageError(f"{path}: not an image MNN's runtime decodes ({', '.join(_IMAGE_MAGIC.values())})")
        if kind == "img":
            _check_image_decodes(path)
        if kind == "audio" and not (head[:4] == b"RIFF" and head[8:12] == b"WAVE"):
            raise UsageError(f"{path}: not a WAV file (MNN's runtime reads RIFF/WAVE audio only)")


def _check_image_decodes(path: Path) -> None:
    """UsageError unless the whole image decodes and holds at most ``MAX_IMAGE_PIXELS``: MNN's
    ``CV::imread`` prints "Can't open" for a truncated file and the prompt goes on without the image
    (measured with 3.6.1), and it decodes the full image before any resize."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise UsageError(f"{path}: {width}x{height} pixels, more than the {MAX_IMAGE_PIXELS:,} an image may "
                                 "have here (resize it first)")
            image.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise UsageError(f"{path}: the image does not decode ({str(exc).splitlines()[0] if str(exc) else 'corrupt'})"
                         ) from None


def media_tag(kind: str, path: str) -> str:
    """The runtime's prompt tag for a media file (absolute, so the runtime's working folder does not matter)."""
    if "<" in path or ">" in path:
        raise UsageError(f"{path}: a media path with '<' or '>' cannot be passed in the runtime's prompt tags")
    tag = "img" if kind == "image" else "audio"
    return f"<{tag}>{os.path.abspath(path)}</{tag}>"
