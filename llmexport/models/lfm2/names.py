"""LFM2's tensor names (``Lfm2ForCausalLM`` / ``Lfm2MoeForCausalLM`` as ``save_pretrained`` writes
them; the keys of the Llama layout where the piece is the same)."""

from __future__ import annotations

from llmexport.models.tensor_names import NameTable

#: the short-conv layer's projections (in_proj -> B, C, x; out_proj)
CONV_LINEARS = ("conv.in", "conv.out")

LFM2_NAMES = NameTable({
    "embed": "model.embed_tokens.weight",
    "norm.final": "model.embedding_norm.weight",  # applied after the last layer, despite its name
    "lm_head": "lm_head",
    "attn.q": "model.layers.{layer}.self_attn.q_proj",
    "attn.k": "model.layers.{layer}.self_attn.k_proj",
    "attn.v": "model.layers.{layer}.self_attn.v_proj",
    "attn.o": "model.layers.{layer}.self_attn.out_proj",
    "norm.q": "model.layers.{layer}.self_attn.q_layernorm.weight",
    "norm.k": "model.layers.{layer}.self_attn.k_layernorm.weight",
    "conv.in": "model.layers.{layer}.conv.in_proj",
    "conv.out": "model.layers.{layer}.conv.out_proj",
    "conv.weight": "model.layers.{layer}.conv.conv.weight",  # [hidden, 1, conv_L_cache]
    "norm.input": "model.layers.{layer}.operator_norm.weight",
    "norm.post_attention": "model.layers.{layer}.ffn_norm.weight",
    "mlp.gate": "model.layers.{layer}.feed_forward.w1",
    "mlp.up": "model.layers.{layer}.feed_forward.w3",
    "mlp.down": "model.layers.{layer}.feed_forward.w2",
    # LFM2-MoE's sparse layers: a sigmoid router, its selection-only bias, per-expert MLPs (the
    # checkpoint layout; transformers stacks them as ``reference.experts.*``)
    "moe.router": "model.layers.{layer}.feed_forward.gate",
    "moe.router.bias": "model.layers.{layer}.feed_forward.expert_bias",
    "moe.expert": "model.layers.{layer}.feed_forward.experts.{expert}",
    "moe.expert.gate": "model.layers.{layer}.feed_forward.experts.{expert}.w1",
    "moe.expert.up": "model.layers.{layer}.feed_forward.experts.{expert}.w3",
    "moe.expert.down": "model.layers.{layer}.feed_forward.experts.{expert}.w2",
    "reference.experts.gate_up": "model.layers.{layer}.feed_forward.experts.gate_up_proj",  # [E, 2 * width, hidden]
    "reference.experts.down": "model.layers.{layer}.feed_forward.experts.down_proj",  # [E, hidden, width]
})

#: mlx-lm's port (mlx_lm/models/lfm2.py, lfm2_moe.py ``sanitize``): HF's names except the conv
#: kernel, stored [hidden, kernel, 1] (MLX's Conv1d layout), LFM2-MoE's MLPs renamed w1/w3/w2 ->
#: gate_proj/up_proj/down_proj, and its experts stacked as SwitchGLU's ``switch_mlp`` [E, out, in].
#: Values: (key, expert split). mlx-lm's head is always the token table (``as_linear``).
MLX_CONV = "model.layers.{layer}.conv.conv.weight"
MLX_RENAMED = {
    "model.layers.{layer}.feed_forward.gate_proj.weight": ("mlp.gate", False),
    "model.layers.{layer}.feed_forward.up_proj.weight": ("mlp.up", False),
    "model.layers.{layer}.feed_forward.down_proj.weight": ("mlp.down", False),
    "model.layers.{layer}.feed_forward.switch_mlp.gate_proj.weight": ("moe.expert.gate", True),
    "model.layers.{layer}.feed_forward.switch_mlp.up_proj.weight": ("moe.expert.up", True),
    "model.layers.{layer}.feed_forward.switch_mlp.down_proj.weight": ("moe.expert.down", True),
}
