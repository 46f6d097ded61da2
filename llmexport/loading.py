"""Open a checkpoint as its architecture: the family from the registry, over the checkpoint
itself or, when it is pre-quantized (MLX, GPTQ, AWQ), over the importer's HF view of it."""

from __future__ import annotations

from llmexport.checkpoint import Checkpoint
from llmexport.importers import adapt_checkpoint
from llmexport.models import architecture_class
from llmexport.models.base import Architecture


def open_architecture(checkpoint: Checkpoint) -> Architecture:
    """The registered family of an opened checkpoint, built on the tensors it will export."""
    cls = architecture_class(checkpoint)
    return cls(adapt_checkpoint(checkpoint, cls.mlx_layout))
