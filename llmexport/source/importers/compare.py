"""Verification evidence for pre-quantized checkpoints: do the stored records equal the source's values?"""

from __future__ import annotations

from typing import Any

import torch

from llmexport.source.importers.formats import QUANTIZED_TABLES, imported_store, tables_format
from llmexport.spec import Prequantized, SourcedModel, StoredModel, WeightStore


def compare_with_source(arch: SourcedModel, store: WeightStore, stored: StoredModel) -> dict[str, Any] | None:
    """Verification evidence for pre-quantized checkpoints: how many read-back linears and tables
    equal the source's fp32 values exactly, and how far the others moved (None when ``store``, the
    checkpoint's store, is not an importer's)."""
    weights = imported_store(store)
    if weights is None:
        return None
    exact, changed = 0, {}
    for name in sorted(stored.text_linears()):
        value = stored.linear(name)
        source = arch.linear_source(name)
        value_in_source = weights.stored(source.weight, source.expert)
        ref = value_in_source.dequantize() if isinstance(value_in_source, Prequantized) else value_in_source.float()
        if torch.equal(ref, value):
            exact += 1
        else:
            changed[name] = {"stored": weights.label(source.weight),
                             "max_abs_diff": float((ref - value).abs().max())}
    tables = {}
    # The token table: the embedding rows, joined with the PLE rows where the model has them
    # (the MNN writer stores them as one table, reported under "embedding").
    lazies = {lazy.name: lazy for lazy in (arch.embedding_table(), arch.ple_table()) if lazy is not None}
    names = stored.table_tensors()
    if any(isinstance(lazies[name], QUANTIZED_TABLES) for name in names):
        diff = max(float((lazies[name].read().float() - stored.read(name)).abs().max()) for name in names)
        tables["embedding"] = {"stored": tables_format(lazies[name] for name in names), "exact": diff == 0.0,
                               "max_abs_diff": diff}
    return {"linears_exact": exact, "linears_changed": changed, "tables": tables}

