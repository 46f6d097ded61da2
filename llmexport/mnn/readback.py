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
from typing import Callable, Collection, Sequence

import torch

from llmexport.mnn.config import FOLDED_NORMS, TableKeys
from llmexport.mnn.convert import mnn_to_json
from llmexport.mnn.embeddings import read_embedding_table
from llmexport.mnn.token_table import token_table
from llmexport.mnn.weight_reader import read_linear
from llmexport.spec import (
    UNTIED_HEAD,
    LinearSource,
    LinearSpec,
    ModelTables,
    ReferenceTensors,
    SourcedModel,
    SourcedTower,
    rows_at,
)


def linear_records(export_dir: Path, stem: str = "llm", names: Collection[str] | None = None) -> dict[str, dict]:
    """Convolution ops of ``{stem}.mnn`` that read their weights from ``{stem}.mnn.weight``, by name:
    external offsets, quanParameter, shape. ``names``: only those (a tower's linears; its other
    convolutions, such as an audio tower's subsampling, are not linear records)."""
    with tempfile.TemporaryDirectory(prefix="llmexport-readback-") as tmp:
        graph = mnn_to_json(export_dir / f"{stem}.mnn", Path(tmp) / f"{stem}.json")
    records = {}
    ops = list(graph["oplists"]) + [op for sub in graph.get("subgraphs", []) for op in sub["nodes"]]
    for op in ops:
        if op.get("type") == "Convolution" and "external" in op.get("main", {}) \
                and (names is None or op.get("name") in names):
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
    keys = None if tie is None else TableKeys.from_config(tie)
    layout = (16, 0, None) if keys is None else (keys.quant_bit, keys.quant_block, keys.alpha_size)
    return {"embedding": _table(export_dir / config["embedding_file"], table.shape, layout)}


def _table(path: Path, shape, layout: tuple[int, int, int | None]) -> StoredTable:
    rows, dim = (int(d) for d in shape)
    bits, block, alpha_bytes = layout
    return StoredTable(rows, dim, lambda start, stop: read_embedding_table(
        path, rows, dim, bits, block, alpha_bytes=alpha_bytes, row_range=(start, stop)))




@dataclass(frozen=True)
class _Record:
    file: Path
    fields: dict

    def read(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        f = self.fields
        return read_linear(self.file, f["external"], f["quanParameter"], f["oc"], f["ic"])


class StoredTensors:
    """What an export stored, in the checkpoint's tensor names (``ReferenceTensors``), read on demand.

    Every linear record (the text graph's and each tower's) is decoded with the independent reader
    into the tensor its ``linear_source`` names (experts stacked back along their first axis, a
    bias into its own tensor); the token table, decoded as the runtime's DiskEmbedding does, into
    the embedding and PLE tensors it joins (mnn/token_table.py); a tied lm_head stored apart from
    that table becomes ``UNTIED_HEAD``; a norm weight that activation-aware scaling folded
    (llmexport.calibration.folding), the folded value the graph holds (``folded_norms``). Every other tensor is
    ``base``'s (the checkpoint's own).
    This is the fair oracle's weights; tables are read row by row, so a lookup never decodes a table.
    """

    def __init__(self, export_dir: Path, model: SourcedModel, base: ReferenceTensors,
                 towers: Sequence[SourcedTower] = ()):
        self.base = base
        self.records: dict[str, _Record] = {}
        self._text: list[str] = []
        self._parts: dict[str, list[tuple[str, int | None, bool]]] = {}
        self._biases: dict[str, str] = {}
        owners: list[tuple[str, Callable[[str], LinearSource], Collection[str] | None, list[LinearSpec]]] = [
            ("llm", model.linear_source, None, model.linears())]
        owners += [(t.name, t.linear_source, {spec.name for spec in t.linears()}, t.linears()) for t in towers]
        for stem, source_of, names, specs in owners:
            found = linear_records(export_dir, stem, names)
            missing = [spec.name for spec in specs if spec.name not in found]
            if missing:
                raise ValueError(f"{export_dir / (stem + '.mnn')}: {len(missing)} linear(s) have no record in the "
                                 f"graph, e.g. {missing[0]!r}")
            if stem == "llm":
                self._text = list(found)
            for name, fields in found.items():
                self.records[name] = _Record(export_dir / f"{stem}.mnn.weight", fields)
                source = source_of(name)
                self._parts.setdefault(source.weight, []).append((name, source.expert, source.transposed))
                if source.bias:
                    self._biases[source.bias] = name
        self._table = stored_tables(export_dir, model).get("embedding")
        self._columns = table_columns(model) if self._table else {}
        self._head: str | None = None
        embedding = model.embedding_table().name
        if self._columns and any(record == "lm_head" for record, *_ in self._parts.get(embedding, [])):
            self._head = "lm_head"
            del self._parts[embedding]
        self._biases_read: dict[str, torch.Tensor | None] = {}
        self._folded = folded_norms(export_dir)

    # --- ReferenceTensors ---------------------------------------------------------------------------
    def names(self) -> list[str]:
        return self.base.names() + ([UNTIED_HEAD] if self._head else [])

    def __contains__(self, name: str) -> bool:
        return name in self.base or (name == UNTIED_HEAD and self._head is not None)

    def shape(self, name: str) -> tuple[int, ...]:
        if name == UNTIED_HEAD and self._head:
            return self.base.shape(self._embedding_name())
        return self.base.shape(name)

    def read(self, name: str) -> torch.Tensor:
        if name in self._folded:
            return self._folded[name].clone()
        if name == UNTIED_HEAD and self._head:
            return self.linear(self._head)
        if name in self._columns:
            assert self._table is not None  # columns exist only beside a table
            start, stop = self._columns[name]
            return torch.cat([self._table.read(a, min(a + _TABLE_ROWS, self._table.rows))[:, start:stop]
                              for a in range(0, self._table.rows, _TABLE_ROWS)])
        if name in self._parts:
            return self._assemble(name)
        if name in self._biases:
            bias = self._bias(self._biases[name])
            if bias is None:
                raise ValueError(f"record {self._biases[name]!r} has no bias")
            return bias
        return self.base.read(name)

    def rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        if name in self._columns:
            assert self._table is not None  # columns exist only beside a table
            start, stop = self._columns[name]
            return rows_at(self._table.read, ids)[:, start:stop]
        if name in self._parts or name in self._biases or name == UNTIED_HEAD:
            return self.read(name)[ids]
        return self.base.rows(name, ids)

    # --- what the export stored, record by record ----------------------------------------------------
    def text_linears(self) -> list[str]:
        """The text graph's linear records (the towers' follow them in ``records``)."""
        return self._text

    def table_tensors(self) -> list[str]:
        """The checkpoint tensors the stored token table holds (embedding, then PLE)."""
        return list(self._columns)

    def linear(self, record: str) -> torch.Tensor:
        """One linear record's weight [out, in] as the runtime decodes it."""
        return self._decoded(record)[0]

    def _embedding_name(self) -> str:
        return next(iter(self._columns))

    def _decoded(self, record: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        weight, bias = self.records[record].read()
        self._biases_read[record] = bias  # small; asked for beside the weight: kept, not decoded again
        return weight, bias

    def _bias(self, record: str) -> torch.Tensor | None:
        return self._biases_read[record] if record in self._biases_read else self._decoded(record)[1]

    def _assemble(self, name: str) -> torch.Tensor:
        """One checkpoint tensor from its records: a plain linear, or experts stacked on axis 0."""
        parts = self._parts[name]
        if len(parts) == 1 and parts[0][1] is None:
            return self.linear(parts[0][0])
        shape = self.base.shape(name)
        if len({expert for _, expert, _ in parts}) != shape[0]:
            raise ValueError(f"{len(parts)} expert records for a stack of {shape[0]} in {name!r}")
        stacked = torch.empty(shape, dtype=torch.float32)
        for record, expert, transposed in parts:  # a transposed stack keeps each row [in, out]
            stacked[expert] = self.linear(record).t() if transposed else self.linear(record)
        return stacked


def folded_norms(export_dir: Path) -> dict[str, torch.Tensor]:
    """The norm weights the export folded scales into, by checkpoint name (none: an empty dict)."""
    path = export_dir / FOLDED_NORMS
    if not path.exists():
        return {}
    from safetensors.torch import load_file

    return {name: value.float() for name, value in load_file(str(path)).items()}


_TABLE_ROWS = 16384  # token-table rows decoded at a time when a whole table is read


def table_columns(model: ModelTables) -> dict[str, tuple[int, int]]:
    """Checkpoint tensor -> its columns in the stored token table (mnn/token_table.py: the
    embedding, then the PLE rows where the model has them)."""
    columns, start = {}, 0
    for lazy in (model.embedding_table(), model.ple_table()):
        if lazy is not None:
            width = int(lazy.shape[1])
            columns[lazy.name] = (start, start + width)
            start += width
    return columns
