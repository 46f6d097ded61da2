"""Verification evidence for MLX checkpoints: do the stored records equal the source's values?"""

from __future__ import annotations

from typing import Any

import torch

from llmexport.importers.mlx.format import stored_format
from llmexport.importers.mlx.weights import MlxLazy, MlxWeights
from llmexport.spec import Prequantized, SourcedModel, StoredWeights, WeightStore


def compare_with_source(arch: SourcedModel, weights: WeightStore, stored: StoredWeights) -> dict[str, Any] | None:
    """Verification evidence for pre-quantized (MLX) checkpoints: how many read-back linears and
    tables equal the source's fp32 values exactly, and how far the others moved (None when
    ``weights``, the checkpoint's store, is not an MLX one)."""
    if not isinstance(weights, MlxWeights):
        return None
    exact, changed = 0, {}
    for name, value in sorted(stored.linears.items()):
        source = arch.linear_source(name)
        value_in_source = weights.stored(source.weight, source.expert)
        ref = value_in_source.dequantize() if isinstance(value_in_source, Prequantized) else value_in_source.float()
        if torch.equal(ref, value):
            exact += 1
        else:
            changed[name] = {"stored": stored_format(weights.quantization(source.weight)),
                             "max_abs_diff": float((ref - value).abs().max())}
    tables = {}
    for name, table in (("embedding", stored.embedding), ("ple", stored.ple)):
        lazy = arch.embedding_table() if name == "embedding" else arch.ple_table()
        if table is not None and isinstance(lazy, MlxLazy):
            diff = float((lazy.read().float() - table).abs().max())
            tables[name] = {"stored": stored_format(lazy.quantization), "exact": diff == 0.0, "max_abs_diff": diff}
    return {"linears_exact": exact, "linears_changed": changed, "tables": tables}
