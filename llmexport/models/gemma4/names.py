"""Gemma4's tensor names: the text decoder's, those of its mlx-lm port, and the vision and audio
towers'. Linears are named by their module path (weight ``{path}.weight``; a tower's clippable
linear keeps it under ``{path}.linear``), norms and other graph constants by their tensor
(llmexport/models/tensor_names.py).
"""

from __future__ import annotations

from llmexport.models.decoder.names import MLP  # noqa: F401 (the same keys name Gemma4's dense MLP)
from llmexport.models.tensor_names import NameTable

#: where the text decoder lives: multimodal ``gemma4`` checkpoints, text-only ``gemma4_text`` ones
TEXT_PREFIX = {"gemma4": "model.language_model.", "gemma4_text": "model."}

TEXT = NameTable({
    "embed": "{prefix}embed_tokens.weight",
    "ple.table": "{prefix}embed_tokens_per_layer.weight",
    "ple.model_projection": "{prefix}per_layer_model_projection",
    "norm.ple_projection": "{prefix}per_layer_projection_norm.weight",
    "norm.final": "{prefix}norm.weight",
    "lm_head": "lm_head",
    "attn.q": "{prefix}layers.{layer}.self_attn.q_proj",
    "attn.k": "{prefix}layers.{layer}.self_attn.k_proj",
    "attn.v": "{prefix}layers.{layer}.self_attn.v_proj",
    "attn.o": "{prefix}layers.{layer}.self_attn.o_proj",
    "norm.q": "{prefix}layers.{layer}.self_attn.q_norm.weight",
    "norm.k": "{prefix}layers.{layer}.self_attn.k_norm.weight",
    "norm.input": "{prefix}layers.{layer}.input_layernorm.weight",
    "norm.post_attention": "{prefix}layers.{layer}.post_attention_layernorm.weight",
    "norm.pre_feedforward": "{prefix}layers.{layer}.pre_feedforward_layernorm.weight",
    "norm.post_feedforward": "{prefix}layers.{layer}.post_feedforward_layernorm.weight",
    "mlp.gate": "{prefix}layers.{layer}.mlp.gate_proj",
    "mlp.up": "{prefix}layers.{layer}.mlp.up_proj",
    "mlp.down": "{prefix}layers.{layer}.mlp.down_proj",
    # 26B-A4B: a routed MoE beside the dense MLP, its experts stacked [E, out, in] in the checkpoint
    "moe.router": "{prefix}layers.{layer}.router.proj",
    "moe.router_scale": "{prefix}layers.{layer}.router.scale",
    "moe.per_expert_scale": "{prefix}layers.{layer}.router.per_expert_scale",
    "moe.expert": "{prefix}layers.{layer}.experts.{expert}",
    "moe.expert.gate_up": "{prefix}layers.{layer}.experts.{expert}.gate_up_proj",
    "moe.expert.down": "{prefix}layers.{layer}.experts.{expert}.down_proj",
    "moe.experts.gate_up": "{prefix}layers.{layer}.experts.gate_up_proj",
    "moe.experts.down": "{prefix}layers.{layer}.experts.down_proj",
    "norm.post_feedforward_1": "{prefix}layers.{layer}.post_feedforward_layernorm_1.weight",
    "norm.pre_feedforward_2": "{prefix}layers.{layer}.pre_feedforward_layernorm_2.weight",
    "norm.post_feedforward_2": "{prefix}layers.{layer}.post_feedforward_layernorm_2.weight",
    # E2B/E4B: per-layer embeddings
    "ple.gate": "{prefix}layers.{layer}.per_layer_input_gate",
    "ple.projection": "{prefix}layers.{layer}.per_layer_projection",
    "norm.post_ple": "{prefix}layers.{layer}.post_per_layer_input_norm.weight",
    "layer_scalar": "{prefix}layers.{layer}.layer_scalar",
}, stacked={"moe.expert.gate_up": "moe.experts.gate_up", "moe.expert.down": "moe.experts.down"})

#: a routed expert's linears, and the norms of every layer (``norm.k`` only where a layer has its
#: own keys) and of a layer with experts
EXPERT = ("moe.expert.gate_up", "moe.expert.down")
LAYER_NORMS = ("norm.input", "norm.post_attention", "norm.pre_feedforward", "norm.post_feedforward", "norm.q")
MOE_NORMS = ("norm.post_feedforward_1", "norm.pre_feedforward_2", "norm.post_feedforward_2")

# --- mlx-lm's port (mlx_lm/models/gemma4.py, gemma4_text.py ``sanitize``) ------------------------
#: the text decoder's prefix in it: the multimodal wrapper's ``language_model.model.``
MLX_TEXT_PREFIX = {"gemma4": "language_model.model.", "gemma4_text": "model."}
MLX_TEXT = NameTable({
    "lm_head": "language_model.lm_head",
    "moe.experts.gate": "{prefix}layers.{layer}.experts.switch_glu.gate_proj.weight",
    "moe.experts.up": "{prefix}layers.{layer}.experts.switch_glu.up_proj.weight",
    "moe.experts.down": "{prefix}layers.{layer}.experts.switch_glu.down_proj.weight",
})
#: mlx-lm's SwitchGLU experts -> HF's stacked tensor and which of its row blocks each is
#: (gate_up_proj split in two along its rows)
MLX_EXPERTS = {"moe.experts.gate": ("moe.experts.gate_up", (0, 2)),
               "moe.experts.up": ("moe.experts.gate_up", (1, 2)),
               "moe.experts.down": ("moe.experts.down", (0, 1))}

# --- the towers (vision.py, audio.py): keys are HF's paths inside a layer or tower --
VISION = NameTable({
    "input_proj": "model.vision_tower.patch_embedder.input_proj",
    "position_table": "model.vision_tower.patch_embedder.position_embedding_table",
    "self_attn.q_proj": "model.vision_tower.encoder.layers.{layer}.self_attn.q_proj",
    "self_attn.k_proj": "model.vision_tower.encoder.layers.{layer}.self_attn.k_proj",
    "self_attn.v_proj": "model.vision_tower.encoder.layers.{layer}.self_attn.v_proj",
    "self_attn.o_proj": "model.vision_tower.encoder.layers.{layer}.self_attn.o_proj",
    "self_attn.q_norm": "model.vision_tower.encoder.layers.{layer}.self_attn.q_norm.weight",
    "self_attn.k_norm": "model.vision_tower.encoder.layers.{layer}.self_attn.k_norm.weight",
    "mlp.gate_proj": "model.vision_tower.encoder.layers.{layer}.mlp.gate_proj",
    "mlp.up_proj": "model.vision_tower.encoder.layers.{layer}.mlp.up_proj",
    "mlp.down_proj": "model.vision_tower.encoder.layers.{layer}.mlp.down_proj",
    "input_layernorm": "model.vision_tower.encoder.layers.{layer}.input_layernorm.weight",
    "post_attention_layernorm": "model.vision_tower.encoder.layers.{layer}.post_attention_layernorm.weight",
    "pre_feedforward_layernorm": "model.vision_tower.encoder.layers.{layer}.pre_feedforward_layernorm.weight",
    "post_feedforward_layernorm": "model.vision_tower.encoder.layers.{layer}.post_feedforward_layernorm.weight",
    "std_bias": "model.vision_tower.std_bias",
    "std_scale": "model.vision_tower.std_scale",
    "embedding_projection": "model.embed_vision.embedding_projection",
})
#: an encoder layer's attention projections, MLP and RMSNorms (the graph's ParameterDict keys)
VISION_ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
VISION_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
VISION_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")

AUDIO = NameTable({
    "subsample.layer0.conv": "model.audio_tower.subsample_conv_projection.layer0.conv.weight",
    "subsample.layer0.norm": "model.audio_tower.subsample_conv_projection.layer0.norm.weight",
    "subsample.layer1.conv": "model.audio_tower.subsample_conv_projection.layer1.conv.weight",
    "subsample.layer1.norm": "model.audio_tower.subsample_conv_projection.layer1.norm.weight",
    "subsample.input_proj_linear": "model.audio_tower.subsample_conv_projection.input_proj_linear",
    "feed_forward1.ffw_layer_1": "model.audio_tower.layers.{layer}.feed_forward1.ffw_layer_1",
    "feed_forward1.ffw_layer_2": "model.audio_tower.layers.{layer}.feed_forward1.ffw_layer_2",
    "feed_forward1.pre_layer_norm": "model.audio_tower.layers.{layer}.feed_forward1.pre_layer_norm.weight",
    "feed_forward1.post_layer_norm": "model.audio_tower.layers.{layer}.feed_forward1.post_layer_norm.weight",
    "feed_forward2.ffw_layer_1": "model.audio_tower.layers.{layer}.feed_forward2.ffw_layer_1",
    "feed_forward2.ffw_layer_2": "model.audio_tower.layers.{layer}.feed_forward2.ffw_layer_2",
    "feed_forward2.pre_layer_norm": "model.audio_tower.layers.{layer}.feed_forward2.pre_layer_norm.weight",
    "feed_forward2.post_layer_norm": "model.audio_tower.layers.{layer}.feed_forward2.post_layer_norm.weight",
    "self_attn.q_proj": "model.audio_tower.layers.{layer}.self_attn.q_proj",
    "self_attn.k_proj": "model.audio_tower.layers.{layer}.self_attn.k_proj",
    "self_attn.v_proj": "model.audio_tower.layers.{layer}.self_attn.v_proj",
    "self_attn.post": "model.audio_tower.layers.{layer}.self_attn.post",
    "self_attn.per_dim_scale": "model.audio_tower.layers.{layer}.self_attn.per_dim_scale",
    "self_attn.relative_k_proj": "model.audio_tower.layers.{layer}.self_attn.relative_k_proj.weight",
    "lconv1d.linear_start": "model.audio_tower.layers.{layer}.lconv1d.linear_start",
    "lconv1d.linear_end": "model.audio_tower.layers.{layer}.lconv1d.linear_end",
    "lconv1d.depthwise_conv1d": "model.audio_tower.layers.{layer}.lconv1d.depthwise_conv1d.weight",
    "lconv1d.pre_layer_norm": "model.audio_tower.layers.{layer}.lconv1d.pre_layer_norm.weight",
    "lconv1d.conv_norm": "model.audio_tower.layers.{layer}.lconv1d.conv_norm.weight",
    "norm_pre_attn": "model.audio_tower.layers.{layer}.norm_pre_attn.weight",
    "norm_post_attn": "model.audio_tower.layers.{layer}.norm_post_attn.weight",
    "norm_out": "model.audio_tower.layers.{layer}.norm_out.weight",
    "output_proj": "model.audio_tower.output_proj",
    "embedding_projection": "model.embed_audio.embedding_projection",
})
#: a conformer layer's attention projections, its RMSNorms (in the order the check lists them) and
#: the norms the graph keeps in a ParameterDict (its keys)
AUDIO_ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.post")
AUDIO_NORMS = ("feed_forward1.pre_layer_norm", "feed_forward1.post_layer_norm", "feed_forward2.pre_layer_norm",
               "feed_forward2.post_layer_norm", "norm_pre_attn", "norm_post_attn", "norm_out",
               "lconv1d.pre_layer_norm", "lconv1d.conv_norm")
AUDIO_LAYER_NORMS = ("norm_pre_attn", "norm_post_attn", "norm_out")
