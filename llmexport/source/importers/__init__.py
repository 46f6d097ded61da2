"""Checkpoints in other formats, seen as the HF checkpoints they were converted from.

An importer offers a ``llmexport.spec.WeightStore`` in HF tensor names (as ``SafetensorsIndex``
does for an HF folder), so that families, quantizers and the MNN writer never see the source
format; as a ``llmexport.spec.PrequantizedStore`` it also hands over the stored integers. Today:
``mlx`` (mlx-lm's affine-quantized checkpoints) and ``gptq_awq`` (GPTQ and AWQ's packed int32
linears); ``formats`` picks the importer of a checkpoint.
"""

from llmexport.source.importers.compare import compare_with_source
from llmexport.source.importers.formats import adapt_checkpoint, imported_store

__all__ = ["adapt_checkpoint", "compare_with_source", "imported_store"]
