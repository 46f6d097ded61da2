"""Qwen3 family: dense ``qwen3`` (``Qwen3ForCausalLM``) and sparse ``qwen3_moe`` (``Qwen3MoeForCausalLM``).

Qwen3 is the Llama layout with a per-head RMSNorm of q and k over head_dim before RoPE
(``self_attn.{q,k}_norm.weight`` [head_dim]) and default RoPE; full attention only (sliding
windows are refused). Qwen3-MoE replaces the MLP of its sparse layers with a softmax router
(``mlp.gate``; top-k, optionally renormalised, ``norm_topk_prob``) over SwiGLU experts, which
run on MNN's MoE op. Checkpoints keep one tensor per expert; transformers stacks them into
``experts.gate_up_proj`` / ``experts.down_proj``, which ``reference_slot`` maps onto.
"""

from __future__ import annotations

import re
from typing import Any

from llmexport.models import register
from llmexport.models.plain_decoder import PlainDecoder

_EXPERT = re.compile(r"^(?P<p>model\.layers\.\d+\.mlp\.experts)\.(?P<e>\d+)\.(?P<w>gate|up|down)_proj\.weight$")


@register("qwen3")
class Qwen3(PlainDecoder):
    family = "Qwen3"
    config_class = "Qwen3Config"
    qk_norm = True
    end_of_turn = ("<|im_end|>",)


@register("qwen3_moe")
class Qwen3Moe(Qwen3):
    family = "Qwen3-MoE"
    config_class = "Qwen3MoeConfig"

    def reference_slot(self, tensor: str) -> tuple[str, tuple[Any, ...]]:
        """An expert's gate/up rows of transformers' stacked ``gate_up_proj`` [E, 2 * width, hidden]
        (Qwen3MoeExperts: gate first), or its ``down_proj`` [E, hidden, width]."""
        m = _EXPERT.match(tensor)
        if m is None:
            return super().reference_slot(tensor)
        expert = int(m["e"])
        if m["w"] == "down":
            return m["p"] + ".down_proj", (expert,)
        assert self.args.moe is not None  # expert tensors exist only in MoE checkpoints
        width = self.args.moe.width
        rows = slice(0, width) if m["w"] == "gate" else slice(width, 2 * width)
        return m["p"] + ".gate_up_proj", (expert, rows)
