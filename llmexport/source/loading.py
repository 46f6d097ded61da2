"""Open a checkpoint as its architecture: the family from the registry, over the checkpoint
itself or, when it is pre-quantized (MLX, GPTQ, AWQ), over the importer's HF view of it; with a
LoRA adapter (``--lora_path``), over those tensors with the adapter merged."""

from __future__ import annotations

import copy
from pathlib import Path

from llmexport.errors import InputError
from llmexport.models import architecture_class
from llmexport.models.base import Architecture
from llmexport.source.checkpoint import Checkpoint
from llmexport.source.importers import adapt_checkpoint
from llmexport.source.lora import LoraAdapter, LoraWeights


def open_architecture(checkpoint: Checkpoint, lora: Path | None = None) -> Architecture:
    """The registered family of an opened checkpoint, built on the tensors it will export."""
    cls = architecture_class(checkpoint)
    adapted = adapt_checkpoint(checkpoint, cls.mlx_layout)
    if lora is None:
        return cls(adapted)
    adapter = LoraAdapter.open(lora, adapted.weights)
    merged = copy.copy(adapted)  # the caller's checkpoint keeps its own tensors
    merged.weights = LoraWeights(adapted.weights, adapter)
    arch = cls(merged)
    _check_read(arch, adapter)
    return arch


def exported_tensors(arch: Architecture) -> set[str]:
    """The checkpoint tensors the export reads as linears (text and towers, weights and biases)
    and token tables: what an adapter may change."""
    sources = [arch.linear_source(spec.name) for spec in arch.linears()]
    sources += [tower.linear_source(spec.name) for tower in arch.towers() for spec in tower.linears()]
    tables = [arch.embedding_table(), arch.ple_table()]
    return ({s.weight for s in sources} | {s.bias for s in sources if s.bias}
            | {t.name for t in tables if t is not None})


def _check_read(arch: Architecture, adapter: LoraAdapter) -> None:
    """Every tensor the adapter changes must reach the export: one it would silently drop (a tied
    model's stored ``lm_head.weight``, a norm) is refused."""
    unread = sorted(adapter.targets() - exported_tensors(arch))
    if unread:
        raise InputError(f"{adapter.folder}: {adapter.key_of(unread[0])!r}: the export does not read "
                         f"{unread[0]!r} as a linear or token table, so the adapter's change to it would be lost")
