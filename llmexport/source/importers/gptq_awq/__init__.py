"""GPTQ and AWQ checkpoints (an HF ``quantization_config`` with ``quant_method`` "gptq" or "awq"),
read so that their integers reach MNN unchanged wherever an MNN record holds them exactly.

The formats, as AutoGPTQ / GPTQModel and AutoAWQ write them and transformers' integrations read
them (every linear ``P`` keeps its HF name; ``P.weight`` is replaced by):

* GPTQ: ``P.qweight`` int32 ``[in * bits / 32, out]``, each column one little-endian bit stream
  along the inputs (value i in bits ``[i*bits, (i+1)*bits)``; 3-bit values straddle words);
  ``P.qzeros`` int32 ``[groups, out * bits / 32]``, the same stream along the outputs;
  ``P.scales`` fp16 ``[groups, out]``; ``P.g_idx`` int32 ``[in]``, the group of each input
  (``i // group`` unless act-order permuted it); groups = ceil(in / group), group -1 = in.
  ``w = scale * (q - zero)``; ``checkpoint_format`` "gptq" (v1, the default) stores ``zero - 1``,
  "gptq_v2" the zero itself. ``sym`` means every zero is ``2^(bits-1)``; the reader looks at
  the zeros, not the flag.
* AWQ ("gemm" version, 4 bits): ``P.qweight`` int32 ``[in, out / 8]`` and ``P.qzeros``
  ``[groups, out / 8]``, 8 output columns per word in the slot order [0, 2, 4, 6, 1, 3, 5, 7]
  (slot j = bits ``[4j, 4j+4)``); ``P.scales`` fp16 ``[groups, out]``; ``w = (q - zero) * scale``.

MNN's asymmetric record holds the same map when a group is a run of consecutive inputs: stored
level ``q``, ``scale``, ``zero' = scale * (2^(bits-1) - zero)`` (the value of the signed level 0).
A 16-bit scale times an integer of at most 9 bits is exact in fp32, so the record decodes to
exactly fp32 ``scale * (q - zero)``; ``zero'`` needs up to 20 significant bits, so such records
keep their alpha in fp32 (as MLX's do); where every zero is ``2^(bits-1)`` (GPTQ's ``sym``),
``zero'`` is 0 and the record is MNN's symmetric one (scales only). Groups of 32, 64, 128 and
256, and group -1 (one block per row), map; act-order (a permuted ``g_idx``) and other group sizes
are dequantized and quantized afresh (llmexport.planning.schemes says which and why).
"""

from llmexport.source.importers.gptq_awq.checkpoint import adapt_packed
from llmexport.source.importers.gptq_awq.format import PackedFormat, packed_format, packed_quantization
from llmexport.source.importers.gptq_awq.weights import PackedLazy, PackedWeights

__all__ = ["PackedFormat", "PackedLazy", "PackedWeights", "adapt_packed", "packed_format", "packed_quantization"]
