"""Checkpoints in other formats, seen as the HF checkpoints they were converted from.

An importer offers a ``llmexport.spec.WeightStore`` in HF tensor names (as ``SafetensorsIndex``
does for an HF folder), so that families, quantizers and the MNN writer never see the source
format. Today: ``mlx`` (mlx-lm's affine-quantized checkpoints).
"""
