"""What MNN 3.6.1's files can hold: the widths and blocks of linear records and token tables.

The one home of these numbers (the options, the schemes, the record and table writers and the
MLX import all check against them). Facts from MNN's loaders, in our words:

* linear records (source/core/ConvolutionCommon.cpp): packed integer levels of 2, 3, 4 or 8 bits,
  or raw fp16; MNN derives the block from the number of stored scales, and this exporter writes
  the blocks MNN's own exporter offers (0 = one block per output row);
* token tables (transformers/llm/engine/src/diskembedding.cpp): bf16, or 8 or 4 bits; every
  width other than 8 goes through the 4-bit routine, so 2- and 3-bit tables decode wrongly.
"""

from __future__ import annotations

#: a linear record's raw fp16 width ("16 = fp16" on the command line)
FP16_BITS = 16
#: packed widths of a quantized linear record
LINEAR_BITS = (2, 3, 4, 8)
#: every width a linear record takes
RECORD_BITS = LINEAR_BITS + (FP16_BITS,)
#: blocks along the input width (0: one block per output row)
BLOCKS = (0, 32, 64, 128, 256)
#: blocks a record keeping a source's own integers may carry: BLOCKS and llama.cpp's 16-value
#: Q6_K blocks (MNN derives a record's block from its scale count; tests/test_gguf_mnn.py runs
#: such records in the runtime's x86 and ARM kernels)
KEPT_BLOCKS = (16,) + BLOCKS[1:]
#: widths of a token table read from its own file (16: bf16)
TABLE_BITS = (16, 8, 4)
#: the quantized ones among them
QUANTIZED_TABLE_BITS = (8, 4)
