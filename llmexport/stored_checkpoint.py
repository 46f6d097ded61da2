"""What an export stored, written back as a HF checkpoint folder (one fp32 safetensors file).

Verification's fair oracle is the HF model carrying exactly the weights the export stored.
Built in memory (``read_stored`` + ``Architecture.load_reference``) it costs the fp32 model plus
the decoded copies, about 8 bytes per parameter: a 12-layer E2B-shaped model (1.9B parameters)
passes 8.5 GB before its first forward. Written as an fp32 folder instead, transformers maps the
tensors straight from the file (no copy when the dtype matches), so table rows a prompt never
looks up are never read, and what is read stays reclaimable page cache. The folder holds every
tensor of the source checkpoint: linears and tables as decoded from the export (the records
through the independent reader, the tables as the runtime's DiskEmbedding decodes them), every
other tensor as in the source, widened to fp32.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np
import torch

from llmexport.checkpoint import LazyTensor
from llmexport.mnn.config import LLM_WEIGHT
from llmexport.mnn.readback import linear_records, stored_tables
from llmexport.mnn.weight_reader import read_linear
from llmexport.models.base import Architecture
from llmexport.spec import WeightStore

FILE_NAME = "model.safetensors"
_ROWS_BYTES = 64 << 20  # table rows decoded at a time
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
                       torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def write_stored_checkpoint(export_dir: Path | None, arch: Architecture, out: Path) -> Path:
    """Write ``out`` (config, tokenizer files, ``model.safetensors``) holding the weights the export
    in ``export_dir`` stored; with ``export_dir`` None, the source checkpoint itself in fp32."""
    weights = arch.checkpoint.weights
    records = linear_records(export_dir) if export_dir is not None else {}
    parts: dict[str, list[tuple[str, int | None]]] = {}
    biases: dict[str, str] = {}
    for name in records:
        source = arch.linear_source(name)
        parts.setdefault(source.weight, []).append((name, source.expert))
        if source.bias:
            biases[source.bias] = name
    tables = stored_tables(export_dir, arch) if export_dir is not None else {}
    columns = _table_columns(weights, arch) if tables else {}
    # A tied lm_head beside a stored token table is its own tensor in the oracle (untied).
    head = None
    embedding = _name_of(weights, arch.embedding_table())
    if columns and any(record == "lm_head" for record, _ in parts.get(embedding, [])):
        head = HEAD_TENSOR
        del parts[embedding]
    out.mkdir(parents=True, exist_ok=True)
    for file in arch.checkpoint.path.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors") and file.name != "model.safetensors.index.json":
            shutil.copy2(file, out / file.name)
    if head is not None:
        _untie_config(out / "config.json")
    names = weights.names()
    weight_file = None if export_dir is None else export_dir / LLM_WEIGHT

    def linear(record_name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert weight_file is not None  # records exist only where an export was read
        rec = records[record_name]
        return read_linear(weight_file, rec["external"], rec["quanParameter"], rec["oc"], rec["ic"])

    extra = {head: (weights.shape(embedding), torch.float32)} if head else {}
    with open(out / FILE_NAME, "wb") as f:
        f.write(_header(weights, names, extra))
        for name in names:
            if name in columns:
                table = tables["embedding"]
                start, stop = columns[name]
                for chunk in _row_chunks(table.rows, table.dim, table.read):
                    _write(f, chunk[:, start:stop])
            elif name in parts:
                _write(f, _assemble(weights.shape(name), parts[name], linear))
            elif name in biases:
                bias = linear(biases[name])[1]
                assert bias is not None, f"record {biases[name]!r} has no bias"
                _write(f, bias)
            else:
                value = weights.tensor(name)
                _write(f, value.float() if value.is_floating_point() else value)
        if head is not None:
            _write(f, linear("lm_head")[0])
    return out


HEAD_TENSOR = "lm_head.weight"


def _table_columns(weights: WeightStore, arch: Architecture) -> dict[str, tuple[int, int]]:
    """Checkpoint tensor -> its columns in the stored token table (mnn/token_table.py: the
    embedding, then the PLE rows where the model has them)."""
    columns, start = {}, 0
    for lazy in (arch.embedding_table(), arch.ple_table()):
        if lazy is not None:
            width = int(lazy.shape[1])
            columns[_name_of(weights, lazy)] = (start, start + width)
            start += width
    return columns


def _untie_config(path: Path) -> None:
    config = json.loads(path.read_text())
    for cfg in (config, config.get("text_config")):
        if isinstance(cfg, dict):
            cfg["tie_word_embeddings"] = False
    path.write_text(json.dumps(config, indent=2))


def _header(weights: WeightStore, names: list[str], extra: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> bytes:
    """The safetensors header (length + JSON, padded to 8 bytes): every float tensor as F32, then
    the ``extra`` tensors (name -> shape, dtype)."""
    header, offset = {}, 0
    entries = [(n, tuple(weights.shape(n)), _stored_dtype(weights.dtype(n))) for n in names]
    for name, shape_, dtype in entries + [(n, tuple(s), d) for n, (s, d) in extra.items()]:
        shape = list(shape_)
        size = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _stored_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype.is_floating_point else dtype


def _name_of(weights: WeightStore, table: LazyTensor | None) -> str:
    """The checkpoint tensor a table was opened from."""
    if table is None or table.name not in weights:
        raise ValueError(f"table {getattr(table, 'name', None)!r} is not a tensor of the checkpoint")
    return table.name


def _assemble(shape, parts: list[tuple[str, int | None]], linear) -> torch.Tensor:
    """One checkpoint tensor from its records: a plain linear, or experts stacked on axis 0."""
    if len(parts) == 1 and parts[0][1] is None:
        return linear(parts[0][0])[0]
    stacked = torch.zeros(tuple(shape), dtype=torch.float32)
    for record_name, expert in parts:
        stacked[expert] = linear(record_name)[0]
    if len({expert for _, expert in parts}) != shape[0]:
        raise ValueError(f"{len(parts)} expert records for a stack of {shape[0]}")
    return stacked


def _row_chunks(rows: int, dim: int, read) -> Iterator[torch.Tensor]:
    step = max(1, _ROWS_BYTES // (4 * max(dim, 1)))
    for start in range(0, rows, step):
        yield read(start, min(start + step, rows))


def _write(f: BinaryIO, value: torch.Tensor) -> None:
    f.write(value.detach().contiguous().cpu().numpy().tobytes())
