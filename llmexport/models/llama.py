"""Llama family (``model_type`` "llama", ``LlamaForCausalLM``): Llama 2/3/3.1/3.2 text decoders.

GQA attention, SwiGLU MLP, RMSNorm, default or Llama-3 ("llama3") RoPE frequency scaling, tied
or untied embeddings, optional q/k/v/o biases (``attention_bias``). Reference: transformers'
``LlamaForCausalLM``. Llama-3 tokenizers use ``ignore_merges``; the tokenizer writer exports
them only when no vocabulary word needs that lookup (docs/supported-models.md).
"""

from __future__ import annotations

from llmexport.mnn.config import Precision
from llmexport.models.decoder.plain import PlainDecoder


class Llama(PlainDecoder):
    #: fp16 activations hold on MNN's ARM kernels (docs/benchmarks.md, "fp16 on ARM")
    precision = Precision.LOW
    family = "Llama"
    config_class = "LlamaConfig"
    rope_types = ("default", "llama3")
    end_of_turn = ("<|eot_id|>", "<|eom_id|>")  # Llama 3 chat turns and tool-call turns
