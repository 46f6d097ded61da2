"""Qwen3.5's tensor names: the Llama layout's norms, MLP and experts under a ``{prefix}`` that
differs by model type (``model.language_model`` in the multimodal checkpoints, ``model`` in what
``AutoModelForCausalLM`` saves), the Gated DeltaNet layers' ``linear_attn`` tensors, the gated
attention's q (query and gate) projection, and the sparse block's shared expert and its gate."""

from __future__ import annotations

from llmexport.models.tensor_names import NameTable

#: where the text model sits: the multimodal checkpoints (Qwen3_5Model.language_model) and the
#: causal LM's (Qwen3_5ForCausalLM.model)
MULTIMODAL_PREFIX, TEXT_PREFIX = "model.language_model", "model"
#: what a multimodal checkpoint holds besides the text model (left out: a later export of the tower)
VISION_PREFIX = "model.visual."

QWEN3_5_NAMES = NameTable({
    "embed": "{prefix}.embed_tokens.weight",
    "norm.final": "{prefix}.norm.weight",
    "lm_head": "lm_head",
    "norm.input": "{prefix}.layers.{layer}.input_layernorm.weight",
    "norm.post_attention": "{prefix}.layers.{layer}.post_attention_layernorm.weight",
    # gated full attention: q_proj [heads * 2 * head_dim] holds each head's query then its gate
    "attn.q": "{prefix}.layers.{layer}.self_attn.q_proj",
    "attn.k": "{prefix}.layers.{layer}.self_attn.k_proj",
    "attn.v": "{prefix}.layers.{layer}.self_attn.v_proj",
    "attn.o": "{prefix}.layers.{layer}.self_attn.o_proj",
    "norm.q": "{prefix}.layers.{layer}.self_attn.q_norm.weight",
    "norm.k": "{prefix}.layers.{layer}.self_attn.k_norm.weight",
    # Gated DeltaNet
    "delta.qkv": "{prefix}.layers.{layer}.linear_attn.in_proj_qkv",
    "delta.z": "{prefix}.layers.{layer}.linear_attn.in_proj_z",
    "delta.b": "{prefix}.layers.{layer}.linear_attn.in_proj_b",
    "delta.a": "{prefix}.layers.{layer}.linear_attn.in_proj_a",
    "delta.out": "{prefix}.layers.{layer}.linear_attn.out_proj",
    "delta.conv": "{prefix}.layers.{layer}.linear_attn.conv1d.weight",  # [channels, 1, kernel]
    "delta.A_log": "{prefix}.layers.{layer}.linear_attn.A_log",
    "delta.dt_bias": "{prefix}.layers.{layer}.linear_attn.dt_bias",
    "delta.norm": "{prefix}.layers.{layer}.linear_attn.norm.weight",
    # dense MLP
    "mlp.gate": "{prefix}.layers.{layer}.mlp.gate_proj",
    "mlp.up": "{prefix}.layers.{layer}.mlp.up_proj",
    "mlp.down": "{prefix}.layers.{layer}.mlp.down_proj",
    # sparse block: router, routed experts (one module per expert, as transformers' save_pretrained
    # writes them, or stacked: STACKED_EXPERTS), shared expert
    "moe.router": "{prefix}.layers.{layer}.mlp.gate",
    "moe.expert": "{prefix}.layers.{layer}.mlp.experts.{expert}",
    "moe.expert.gate": "{prefix}.layers.{layer}.mlp.experts.{expert}.gate_proj",
    "moe.expert.up": "{prefix}.layers.{layer}.mlp.experts.{expert}.up_proj",
    "moe.expert.down": "{prefix}.layers.{layer}.mlp.experts.{expert}.down_proj",
    # an expert of a stacked checkpoint: one fused gate_up linear (a row of gate_up_proj)
    "moe.expert.gate_up": "{prefix}.layers.{layer}.mlp.experts.{expert}.gate_up_proj",
    "shared.gate": "{prefix}.layers.{layer}.mlp.shared_expert.gate_proj",
    "shared.up": "{prefix}.layers.{layer}.mlp.shared_expert.up_proj",
    "shared.down": "{prefix}.layers.{layer}.mlp.shared_expert.down_proj",
    "shared.router": "{prefix}.layers.{layer}.mlp.shared_expert_gate",
    # where transformers keeps the experts (Qwen3_5MoeExperts), and some checkpoints (mlx-lm's
    # sanitize reads them): stacked, gate rows before up rows
    "reference.experts.gate_up": "{prefix}.layers.{layer}.mlp.experts.gate_up_proj",  # [E, 2 * width, hidden]
    "reference.experts.down": "{prefix}.layers.{layer}.mlp.experts.down_proj",  # [E, hidden, width]
})
#: the table of a checkpoint whose routed experts are stored stacked: each expert's fused gate_up
#: and its down projection read as its row of ``gate_up_proj`` / ``down_proj``
QWEN3_5_STACKED = QWEN3_5_NAMES.extended({}, stacked={"moe.expert.gate_up": "reference.experts.gate_up",
                                                      "moe.expert.down": "reference.experts.down"})
#: the shared expert's gated MLP (gate, up, down)
SHARED_MLP = ("shared.gate", "shared.up", "shared.down")
DELTA_CONSTANTS = ("delta.A_log", "delta.dt_bias")

# --- mlx-lm's port (mlx_lm/models/qwen3_5.py, qwen3_5_moe.py ``sanitize``) --------------------------
#: where mlx-lm keeps the multimodal text model and its head (the tower and ``mtp.*`` are dropped)
MLX_TEXT_PREFIX, MLX_HEAD = "language_model.model", "language_model.lm_head"
#: gammas mlx-lm stores as ``1 + w`` (its RMSNorm multiplies by the weight; the DeltaNet's gated
#: norm already does and is stored as is)
MLX_OFFSET_NORMS = ("norm.final", "norm.input", "norm.post_attention", "norm.q", "norm.k")
#: HF's conv kernel [channels, 1, kernel], stored [channels, kernel, 1] (MLX's Conv1d)
MLX_TRANSPOSED = "delta.conv"
#: the routed experts stacked as SwitchGLU's ``switch_mlp`` [E, out, in]
MLX_EXPERTS = NameTable({
    "moe.expert.gate": "{prefix}.layers.{layer}.mlp.switch_mlp.gate_proj.weight",
    "moe.expert.up": "{prefix}.layers.{layer}.mlp.switch_mlp.up_proj.weight",
    "moe.expert.down": "{prefix}.layers.{layer}.mlp.switch_mlp.down_proj.weight",
})
