"""A GPTQ or AWQ checkpoint opened as the HF checkpoint it was quantized from."""

from __future__ import annotations

from llmexport.source.checkpoint import Checkpoint
from llmexport.source.importers.gptq_awq.format import CONFIG_KEY, packed_format, packed_quantization
from llmexport.source.importers.gptq_awq.weights import PackedWeights
from llmexport.source.importers.view import ImportedCheckpoint


def adapt_packed(checkpoint: Checkpoint) -> Checkpoint:
    """``checkpoint`` itself, or its HF view when an HF quantizer wrote it (``quant_method``);
    InputError for a method or layout that is not read here. GPTQ and AWQ keep HF's tensor names
    (``P.weight`` becomes ``P.qweight`` and friends), so no family layout is involved."""
    block = packed_quantization(checkpoint.config)
    if block is None:
        return checkpoint
    where = str(checkpoint.path / "config.json")
    fmt = packed_format(block, where)
    config = {k: v for k, v in checkpoint.config.items() if k != CONFIG_KEY}
    return ImportedCheckpoint(checkpoint, config, PackedWeights(checkpoint.weights, fmt, str(checkpoint.path)))
