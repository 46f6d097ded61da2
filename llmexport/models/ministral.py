"""Ministral family (``model_type`` "ministral", ``MinistralForCausalLM``): Mistral's Llama-layout
decoder with sliding and full attention interleaved by ``layer_types`` (MinistralConfig derives
them from ``sliding_window`` when the config lists none).

No biases, default RoPE; the sliding layers attend to the last ``sliding_window`` keys (the
runtime's "mix" attention). Ministral 3 (``ministral3``: YaRN RoPE and Llama-4 attention scaling)
is a different type and not registered. Reference: transformers' ``MinistralForCausalLM``.
"""

from __future__ import annotations

from llmexport.mnn.config import Precision
from llmexport.models.decoder.args import BY_LAYER_TYPES
from llmexport.models.decoder.plain import PlainDecoder


class Ministral(PlainDecoder):
    #: fp16 activations hold on MNN's ARM kernels (docs/benchmarks.md, "fp16 on ARM")
    precision = Precision.LOW
    family = "Ministral"
    config_class = "MinistralConfig"
    attention_biases = ()
    sliding = BY_LAYER_TYPES
