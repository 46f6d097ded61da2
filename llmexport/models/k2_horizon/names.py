"""K2-Horizon's tensor names: the Llama layout (decoder/names.py) plus MoVA's value router and
experts, the routers' selection biases and the shared experts; and the names of its MLX port."""

from __future__ import annotations

from llmexport.models.decoder.names import LLAMA_LAYOUT

#: the Llama layout plus MoVA's value router and experts, the routers' selection biases and the
#: shared experts
K2_HORIZON_NAMES = LLAMA_LAYOUT.extended({
    "attn.v_router": "model.layers.{layer}.self_attn.v_router",
    "attn.v_router.bias": "model.layers.{layer}.self_attn.v_router.e_score_correction_bias",
    "attn.v_expert": "model.layers.{layer}.self_attn.v_experts.{expert}",
    "moe.router.bias": "model.layers.{layer}.mlp.gate.e_score_correction_bias",
    "shared.gate": "model.layers.{layer}.mlp.shared_experts.gate_proj",
    "shared.up": "model.layers.{layer}.mlp.shared_experts.up_proj",
    "shared.down": "model.layers.{layer}.mlp.shared_experts.down_proj",
})
#: the family's MLX port (docs/k2-horizon.md): the HF names, but routed experts stacked [E, out, in]
#: as mlx-lm's SwitchGLU (``mlp.switch_mlp``) and one SwitchLinear of value experts; MLX name ->
#: the linear each expert's row is
MLX_STACKED = {
    "model.layers.{layer}.mlp.switch_mlp.gate_proj.weight": "moe.expert.gate",
    "model.layers.{layer}.mlp.switch_mlp.up_proj.weight": "moe.expert.up",
    "model.layers.{layer}.mlp.switch_mlp.down_proj.weight": "moe.expert.down",
    "model.layers.{layer}.self_attn.v_experts.weight": "attn.v_expert",
}
#: the shared experts' gated MLP (gate, up, down)
SHARED_MLP = ("shared.gate", "shared.up", "shared.down")
