"""SmolLM3 family (``model_type`` "smollm3", ``SmolLM3ForCausalLM``).

The Llama layout (optional q/k/v/o biases with ``attention_bias``) where some layers use no
RoPE: ``no_rope_layers`` lists 1 (rotate q/k) or 0 (NoPE) per layer, SmolLM3Config deriving it
from ``no_rope_layer_interval`` (every 4th layer without RoPE); SmolLM3Attention skips
``apply_rotary_pos_emb`` there. Optional sliding layers by ``layer_types`` (the config class
makes the NoPE layers sliding with ``use_sliding_window``). Reference: transformers'
``SmolLM3ForCausalLM``.
"""

from __future__ import annotations

from llmexport.mnn.config import Precision
from llmexport.models.decoder.args import BY_LAYER_TYPES
from llmexport.models.decoder.plain import PlainDecoder


class SmolLM3(PlainDecoder):
    #: fp16 activations hold on MNN's ARM kernels (docs/benchmarks.md, "fp16 on ARM")
    precision = Precision.LOW
    family = "SmolLM3"
    mlx_port = True
    config_class = "SmolLM3Config"
    no_rope = True
    sliding = BY_LAYER_TYPES
    end_of_turn = ("<|im_end|>",)
