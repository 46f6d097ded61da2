"""Qwen2 family (``model_type`` "qwen2", ``Qwen2ForCausalLM``): Qwen2, Qwen2.5, DeepSeek-R1-Distill-Qwen.

The Llama layout with biases on the q/k/v projections and none on o_proj (Qwen2Attention builds
them so whatever the config says), default RoPE, and optional sliding windows: with
``use_sliding_window`` the layers from ``max_window_layers`` on attend to the last
``sliding_window`` keys (Qwen2Config's ``layer_types``; the runtime's "mix" attention).
Reference: transformers' ``Qwen2ForCausalLM``.
"""

from __future__ import annotations

from llmexport.mnn.config import Precision
from llmexport.models.decoder.args import BY_LAYER_TYPES
from llmexport.models.decoder.plain import PlainDecoder


class Qwen2(PlainDecoder):
    #: fp16 activations hold on MNN's ARM kernels (docs/benchmarks.md, "fp16 on ARM")
    precision = Precision.LOW
    family = "Qwen2"
    mlx_port = True
    config_class = "Qwen2Config"
    attention_biases = ("attn.q", "attn.k", "attn.v")
    sliding = BY_LAYER_TYPES
    end_of_turn = ("<|im_end|>",)
