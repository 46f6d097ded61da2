"""Read back what an exported folder stores, from its files alone.

The graph is converted to JSON to find each linear's record (``external`` offsets and
``quanParameter``) and decoded with the independent reader; embedding and PLE tables are
decoded as the runtime's DiskEmbedding does (the embedding and PLE rows share one table,
mnn/token_table.py). The result is the fair oracle's weights.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from llmexport.mnn.config import LLM_MODEL, LLM_WEIGHT
from llmexport.mnn.convert import mnn_to_json
from llmexport.mnn.embeddings import read_embedding_table
from llmexport.mnn.token_table import split_rows, token_table
from llmexport.mnn.weight_reader import read_linear
from llmexport.spec import ModelTables, StoredWeights


def linear_records(export_dir: Path) -> dict[str, dict]:
    """Convolution ops of llm.mnn by name: external offsets, quanParameter, shape."""
    with tempfile.TemporaryDirectory(prefix="llmexport-readback-") as tmp:
        graph = mnn_to_json(export_dir / LLM_MODEL, Path(tmp) / "llm.json")
    records = {}
    ops = list(graph["oplists"]) + [op for sub in graph.get("subgraphs", []) for op in sub["nodes"]]
    for op in ops:
        if op.get("type") == "Convolution" and "external" in op.get("main", {}):
            main = op["main"]
            records[op["name"]] = {"external": main["external"], "quanParameter": main.get("quanParameter", {}),
                                   "oc": main["common"]["outputCount"], "ic": main["common"]["inputCount"]}
    return records


@dataclass(frozen=True)
class StoredTable:
    """An embedding or PLE table as the export stored it: ``read(start, stop)`` decodes rows the
    way the runtime's DiskEmbedding does."""

    rows: int
    dim: int
    read: Callable[[int, int], torch.Tensor]


def stored_tables(export_dir: Path, arch: ModelTables) -> dict[str, StoredTable]:
    """The table the runtime reads per token from its own file (mnn/token_table.py), as "embedding"."""
    table = token_table(arch)
    if table is None:
        return {}
    llm_config = json.loads((export_dir / "llm_config.json").read_text())
    config = json.loads((export_dir / "config.json").read_text())
    tie = llm_config.get("tie_embeddings")
    layout = (16, 0, None) if tie is None else (tie["quant_bit"], tie["quant_block"], tie["alpha_size"])
    return {"embedding": _table(export_dir / config["embedding_file"], table.shape, layout)}


def _table(path: Path, shape, layout: tuple[int, int, int | None]) -> StoredTable:
    rows, dim = (int(d) for d in shape)
    bits, block, alpha_bytes = layout
    return StoredTable(rows, dim, lambda start, stop: read_embedding_table(
        path, rows, dim, bits, block, alpha_bytes=alpha_bytes, row_range=(start, stop)))


def read_stored(export_dir: Path, arch: ModelTables) -> StoredWeights:
    weight_file = export_dir / LLM_WEIGHT
    linears = {}
    for name, rec in linear_records(export_dir).items():
        linears[name], _ = read_linear(weight_file, rec["external"], rec["quanParameter"], rec["oc"], rec["ic"])
    tables = stored_tables(export_dir, arch)
    if "embedding" not in tables:
        return StoredWeights(linears, None, None)
    rows = tables["embedding"].read(0, tables["embedding"].rows)
    return StoredWeights(linears, *split_rows(arch, rows))
