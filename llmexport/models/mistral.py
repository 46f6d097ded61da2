"""Mistral family (``model_type`` "mistral", ``MistralForCausalLM``): Mistral 7B, Ministral 8B's
hub checkpoints, Mistral-Nemo and the other Llama-layout Mistral decoders.

The Llama layout without biases, default RoPE, and sliding-window attention on every layer when
``sliding_window`` is set (MistralModel masks all layers with it and ignores ``layer_types``);
the runtime's "mix" attention with every layer on the sliding slice. Reference: transformers'
``MistralForCausalLM``.
"""

from __future__ import annotations

from llmexport.mnn.config import Precision
from llmexport.models.decoder.args import EVERY_LAYER
from llmexport.models.decoder.plain import PlainDecoder


class Mistral(PlainDecoder):
    #: fp16 activations hold on MNN's ARM kernels (docs/benchmarks.md, "fp16 on ARM")
    precision = Precision.LOW
    family = "Mistral"
    mlx_port = True
    config_class = "MistralConfig"
    attention_biases = ()
    sliding = EVERY_LAYER
