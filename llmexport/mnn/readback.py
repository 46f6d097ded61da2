"""Read back what an exported folder stores, from its files alone.

The graph is converted to JSON to find each linear's record (``external`` offsets and
``quanParameter``) and decoded with the independent reader; embedding and PLE tables are
decoded as the runtime's DiskEmbedding does. The result is the fair oracle's weights.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from llmexport.mnn.config import LLM_MODEL, LLM_WEIGHT
from llmexport.mnn.convert import mnn_to_json
from llmexport.mnn.embeddings import read_embedding_table
from llmexport.mnn.weight_reader import read_linear
from llmexport.models.base import Architecture, StoredWeights


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


def read_stored(export_dir: Path, arch: Architecture) -> StoredWeights:
    llm_config = json.loads((export_dir / "llm_config.json").read_text())
    config = json.loads((export_dir / "config.json").read_text())
    weight_file = export_dir / LLM_WEIGHT
    linears = {}
    for name, rec in linear_records(export_dir).items():
        linears[name], _ = read_linear(weight_file, rec["external"], rec["quanParameter"], rec["oc"], rec["ic"])
    embedding = None
    if not arch.tied_embedding:
        rows, dim = arch.embedding_table().shape
        tie = llm_config.get("tie_embeddings")
        path = export_dir / config["embedding_file"]
        embedding = (read_embedding_table(path, rows, dim, 16, 0) if tie is None else
                     read_embedding_table(path, rows, dim, tie["quant_bit"], tie["quant_block"],
                                          alpha_bytes=tie["alpha_size"]))
    ple = None
    table = arch.ple_table()
    if table is not None:
        rows, dim = table.shape
        path = export_dir / llm_config["ple_embed_file"]
        quant = llm_config.get("ple_quant")
        ple = (read_embedding_table(path, rows, dim, 16, 0) if not quant else
               read_embedding_table(path, rows, dim, quant[3], quant[4], alpha_bytes=quant[2]))
    return StoredWeights(linears, embedding, ple)
