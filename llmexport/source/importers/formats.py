"""Which importer, if any, reads a checkpoint: MLX (mlx-lm's ``quantization`` block), GPTQ/AWQ
(an HF ``quantization_config`` whose ``quant_method`` is ``gptq`` or ``awq``) or GGUF (a folder
standing for a GGUF file, whose store is already the importer's)."""

from __future__ import annotations

from typing import Any, Callable, Iterable

from llmexport.source.checkpoint import Checkpoint
from llmexport.source.importers.gguf import GgufLazy, GgufWeights
from llmexport.source.importers.gptq_awq import PackedWeights, adapt_packed
from llmexport.source.importers.mlx import MlxLazy, MlxWeights
from llmexport.source.importers.mlx import adapt_checkpoint as adapt_mlx
from llmexport.source.importers.view import ImportedCheckpoint
from llmexport.spec import MlxLayout, PrequantizedStore, WeightStore


def adapt_checkpoint(checkpoint: Checkpoint,
                     layout_for: Callable[[dict[str, Any]], MlxLayout | None]) -> Checkpoint:
    """``checkpoint`` itself, or the HF view an importer gives of it; ``layout_for`` gives the
    family's MLX layout for a config (``Architecture.mlx_layout``)."""
    if isinstance(checkpoint.weights, GgufWeights):
        return ImportedCheckpoint(checkpoint, checkpoint.config, checkpoint.weights)
    adapted = adapt_mlx(checkpoint, layout_for)
    return adapted if adapted is not checkpoint else adapt_packed(checkpoint)


def imported_store(weights: WeightStore) -> PrequantizedStore | None:
    """``weights`` when an importer offers it (its integers can be kept), else None."""
    return weights if isinstance(weights, (MlxWeights, PackedWeights, GgufWeights)) else None


#: token tables whose stored integers can be kept (MLX's, GGUF's): they offer ``quantization``,
#: ``label`` and ``quantized_rows`` / ``quantized_chunks``
QUANTIZED_TABLES = (MlxLazy, GgufLazy)


def tables_format(tables: Iterable[Any]) -> str:
    """How the parts of a table joined from several (the token table) are stored, for plans and
    reports: an importer's format of each quantized part, "unquantized" for the others."""
    return " + ".join(t.label if isinstance(t, QUANTIZED_TABLES) else "unquantized" for t in tables)
