"""GGUF files (llama.cpp's format), read so that their integers reach MNN unchanged wherever an MNN
record holds them exactly.

``--path model.gguf`` (or a folder or hub repo and ``--gguf_file``; a folder holding one ``.gguf`` and
no config.json needs no flag; a split model is named by its first part) is opened as the HF
checkpoint it was converted from: the config, tokenizer, chat template and stop ids from the
file's metadata (``folder``, ``metadata``, ``config``, ``gemma``: the Gemma keys llama.cpp derives,
``tokenizer``), the tensors under HF names with llama.cpp's q/k row permutation and Gemma3's +1 on
norms undone (``names``, ``weights``). Blocks of ``Q8_0``, ``Q4_0``, ``Q4_1``, ``Q2_K``, ``Q3_K``, ``Q4_K``
(and ``Q5_0``, ``Q5_1``, ``Q5_K``, ``Q6_K`` in 8-bit records) keep their integers (``blocks``; which
linears do is decided in llmexport.planning.schemes, as for MLX and GPTQ); every other type is
dequantized with gguf-py's reference and quantized by the options, the reason in the plan.
"""

from llmexport.source.importers.gguf.file import is_first_part, split_parts
from llmexport.source.importers.gguf.folder import GGUF_LINK, gguf_file_of, materialize, named_file
from llmexport.source.importers.gguf.weights import GgufLazy, GgufWeights, open_weights

__all__ = ["GGUF_LINK", "GgufLazy", "GgufWeights", "gguf_file_of", "is_first_part", "materialize", "named_file",
           "open_weights", "split_parts"]
