"""Qwen3 family: dense ``qwen3`` (``Qwen3ForCausalLM``) and sparse ``qwen3_moe`` (``Qwen3MoeForCausalLM``).

Qwen3 is the Llama layout with a per-head RMSNorm of q and k over head_dim before RoPE
(``self_attn.{q,k}_norm.weight`` [head_dim]) and default RoPE; with ``use_sliding_window`` the
layers from ``max_window_layers`` on slide (Qwen3Config's ``layer_types``, as Qwen2), while
Qwen3-MoE slides every layer (Qwen3MoeAttention reads ``sliding_window``, which its config clears
without ``use_sliding_window``). Qwen3-MoE replaces the MLP of its sparse layers with a softmax router
(``mlp.gate``; top-k, optionally renormalised, ``norm_topk_prob``) over SwiGLU experts, which
run on MNN's MoE op. Checkpoints keep one tensor per expert; transformers stacks them into
``experts.gate_up_proj`` / ``experts.down_proj``, which ``reference_slot`` maps onto.
"""

from __future__ import annotations

from typing import Any

from llmexport.mnn.config import Precision
from llmexport.models.decoder.args import BY_LAYER_TYPES, EVERY_LAYER
from llmexport.models.decoder.names import LLAMA_LAYOUT, stacked_expert_slot
from llmexport.models.decoder.plain import PlainDecoder

#: the Llama layout, and where transformers keeps the experts (Qwen3MoeExperts): stacked
QWEN3_MOE_NAMES = LLAMA_LAYOUT.extended({
    "reference.experts.gate_up": "model.layers.{layer}.mlp.experts.gate_up_proj",  # [E, 2 * width, hidden]
    "reference.experts.down": "model.layers.{layer}.mlp.experts.down_proj",  # [E, hidden, width]
})


class Qwen3(PlainDecoder):
    #: fp16 activations hold on MNN's ARM kernels (docs/benchmarks.md, "fp16 on ARM")
    precision = Precision.LOW
    family = "Qwen3"
    config_class = "Qwen3Config"
    qk_norm = True
    sliding = BY_LAYER_TYPES
    end_of_turn = ("<|im_end|>",)


class Qwen3Moe(Qwen3):
    #: fp32 activations: fp16 flips router choices on MNN's ARM kernels (docs/benchmarks.md, "fp16 on ARM")
    precision = Precision.NORMAL
    family = "Qwen3-MoE"
    config_class = "Qwen3MoeConfig"
    names = QWEN3_MOE_NAMES
    sliding = EVERY_LAYER

    def reference_slot(self, tensor: str) -> tuple[str, tuple[Any, ...]]:
        """An expert's rows of transformers' stacked ``gate_up_proj`` / ``down_proj``
        (decoder/names.py ``stacked_expert_slot``)."""
        slot = stacked_expert_slot(self.names, tensor, self.args.moe.width) if self.args.moe else None
        return slot if slot is not None else super().reference_slot(tensor)
