"""MLX-quantized checkpoints (mlx-lm's affine format), read so that their integers reach MNN unchanged.

The format, as mlx 0.32 / mlx-lm 0.32 write it (``mx.quantize`` mode "affine";
``mlx_lm/utils.py`` ``quantize_model`` and ``save_config``):

* ``config.json`` ``quantization`` (copied to ``quantization_config``): the default
  ``{"group_size", "bits", "mode"}`` plus one entry per module path to which the quant predicate
  gave its own parameters (a dict) or which it left unquantized (``false``). A module is quantized
  exactly when ``P.scales`` exists beside ``P.weight`` (that is how mlx-lm's loader decides).
* a quantized ``P.weight`` is uint32 ``[..., out, in * bits / 32]``; ``P.scales`` and ``P.biases``
  are ``[..., out, in / group]`` in the model dtype. Each row is one bit stream over its
  little-endian words, least significant bit first: value j holds bits ``[j*bits, (j+1)*bits)``
  (checked against ``mx.dequantize`` for 2..8 bits in tests/test_mlx_import.py).
* a value is ``scales * q + biases`` per group with unsigned ``q`` in ``0 .. 2^bits - 1``. Scales
  can be negative and biases are not the group minimum (MLX pins the group's larger-magnitude
  edge at q = 0): only the affine map is guaranteed.

MNN's asymmetric record holds the same map: stored level ``q``, ``scale = scales`` and
``zero = biases + 2^(bits-1) * scales`` (the value of the signed level 0); MNN decodes
``(q - 2^(bits-1)) * scale + zero``. With bf16/fp16 scales ``q * scale`` is exact in fp32 and so
is ``zero`` (short of scale and bias lying ~16 binades apart), so a transcoded record decodes to
exactly fp32 ``scales * q + biases``. ``zero`` needs more mantissa than fp16 has and bf16 scales
can lie outside fp16's range, so such records keep their alpha in fp32 (``scaleStorage FP32``).

Family knowledge (how mlx-lm renames and stacks a family's tensors, which config parts it drops)
comes from ``Architecture.mlx_layout``; which linears keep their integers is decided in
``llmexport.planning.weight_sources``.
"""

from llmexport.source.importers.mlx.checkpoint import MlxCheckpoint, adapt_checkpoint
from llmexport.source.importers.mlx.format import MlxQuantConfig, mlx_quantization, stored_format, unpack_levels
from llmexport.source.importers.mlx.weights import MlxLazy, MlxWeights

__all__ = ["MlxCheckpoint", "MlxLazy", "MlxQuantConfig", "MlxWeights", "adapt_checkpoint",
           "mlx_quantization", "stored_format", "unpack_levels"]
