"""llama.cpp's tensor names (gguf-py's ``TENSOR_NAMES``) and the HF names they came from, for the
decoders read here (a stacked expert tensor: one HF tensor per expert), with the names an
architecture maps otherwise (``ARCH_TENSORS``); which of them ``convert_hf_to_gguf.py`` permuted for
RoPE, and which it squeezed (``UNSQUEEZED``).

llama.cpp's ``LlamaModel.permute`` reorders the rows of ``q_proj`` / ``k_proj`` (weights and biases)
from HF's rotate-half layout (per head: the first half, then the second half of each rotated pair)
to interleaved pairs: per head, rows ``[h, 2, d/2]`` are swapped to ``[h, d/2, 2]``. Qwen2/Qwen3
are written unpermuted (``Qwen2Model`` has no permute).
"""

from __future__ import annotations

import re

#: GGUF name (``{i}`` the block index) -> HF name
TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_output.bias": "model.layers.{i}.self_attn.o_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.mlp.gate.weight",
}
#: LFM2's names, dense and MoE (LFM2-MoE's router and selection bias: ``ffn_gate_inp``, ``exp_probs_b``)
_LFM2: dict[str, str] = {
    "token_embd_norm.weight": "model.embedding_norm.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.operator_norm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.ffn_norm.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.out_proj.weight",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_layernorm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_layernorm.weight",
    "blk.{i}.shortconv.conv.weight": "model.layers.{i}.conv.conv.weight",
    "blk.{i}.shortconv.in_proj.weight": "model.layers.{i}.conv.in_proj.weight",
    "blk.{i}.shortconv.out_proj.weight": "model.layers.{i}.conv.out_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.feed_forward.w1.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.feed_forward.w3.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.feed_forward.w2.weight",
}
#: Gemma's four norms per layer
#: (gguf-py's ``ATTN_POST_NORM``, ``FFN_PRE_NORM`` (named ``ffn_norm`` as Llama's), ``FFN_POST_NORM``)
_GEMMA_NORMS = {
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
}
#: an architecture's own names, before ``TENSORS``: Phi-3 keeps HF's fused ``qkv_proj`` (q, k, v rows)
#: and ``gate_up_proj`` (gate rows, then up) as ``attn_qkv`` / ``ffn_up`` (gguf-py's tensor_mapping;
#: ``Phi3MiniModel`` has no ``modify_tensors``); LFM2 names its final norm ``token_embd_norm``
#: (HF's ``embedding_norm``, applied after the last layer) and its short-conv layers ``shortconv.*``
ARCH_TENSORS: dict[str, dict[str, str]] = {
    "phi3": {
        "blk.{i}.attn_qkv.weight": "model.layers.{i}.self_attn.qkv_proj.weight",
        "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.gate_up_proj.weight",
    },
    "lfm2": _LFM2,
    "lfm2moe": {
        **_LFM2,
        "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.feed_forward.gate.weight",
        "blk.{i}.exp_probs_b.bias": "model.layers.{i}.feed_forward.expert_bias",
    },
    "gemma3": _GEMMA_NORMS,
    # Gemma4's per-layer embeddings (PLE) and layer scalar (gguf-py's PER_LAYER_*, LAYER_OUT_SCALE); 26B-A4B's
    # routed MoE beside the dense MLP (``Gemma4Model.modify_tensors``: the router's ``scale`` as
    # ``ffn_gate_inp.scale``, its ``per_expert_scale`` as ``ffn_down_exps.scale``; FFN_PRE_NORM_2,
    # FFN_POST_NORM_1/2), its experts stacked as HF's own 3-D ``gate_up_proj`` / ``down_proj`` (one HF tensor
    # each, not split: ``ARCH_EXPERTS``)
    "gemma4": {
        **_GEMMA_NORMS,
        "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.router.proj.weight",
        "blk.{i}.ffn_gate_inp.scale": "model.layers.{i}.router.scale",
        "blk.{i}.ffn_down_exps.scale": "model.layers.{i}.router.per_expert_scale",
        "blk.{i}.ffn_gate_up_exps.weight": "model.layers.{i}.experts.gate_up_proj",
        "blk.{i}.ffn_down_exps.weight": "model.layers.{i}.experts.down_proj",
        "blk.{i}.pre_ffw_norm_2.weight": "model.layers.{i}.pre_feedforward_layernorm_2.weight",
        "blk.{i}.post_ffw_norm_1.weight": "model.layers.{i}.post_feedforward_layernorm_1.weight",
        "blk.{i}.post_ffw_norm_2.weight": "model.layers.{i}.post_feedforward_layernorm_2.weight",
        "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
        "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
        "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
        "blk.{i}.layer_output_scale.weight": "model.layers.{i}.layer_scalar",
        "blk.{i}.inp_gate.weight": "model.layers.{i}.per_layer_input_gate.weight",
        "blk.{i}.proj.weight": "model.layers.{i}.per_layer_projection.weight",
        "blk.{i}.post_norm.weight": "model.layers.{i}.post_per_layer_input_norm.weight",
    },
}
#: tensors ``modify_tensors`` squeezed, -> the axis it removed: LFM2's depthwise conv kernel, HF's
#: ``[hidden, 1, L_cache]``, is written ``[hidden, L_cache]`` (``LFM2Model.modify_tensors``: "conv op
#: requires 2d tensor"); its values are not touched
UNSQUEEZED = {"shortconv.conv": 1}
#: a layer's experts stacked in one 3-D tensor ``[experts, out, in]`` -> expert ``{e}``'s HF name
#: (``Qwen2MoeModel.modify_tensors`` stacks the per-expert tensors, expert e at index e)
EXPERTS: dict[str, str] = {
    "blk.{i}.ffn_gate_exps.weight": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
    "blk.{i}.ffn_up_exps.weight": "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
    "blk.{i}.ffn_down_exps.weight": "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
}
#: an architecture's own stacked experts (``LFM2MoeModel.modify_tensors`` stacks w1, w2, w3 the same way);
#: none for Gemma4, whose HF checkpoint keeps them stacked too (``Gemma4TextExperts``)
ARCH_EXPERTS: dict[str, dict[str, str]] = {
    "gemma4": {},
    "lfm2moe": {
        "blk.{i}.ffn_gate_exps.weight": "model.layers.{i}.feed_forward.experts.{e}.w1.weight",
        "blk.{i}.ffn_up_exps.weight": "model.layers.{i}.feed_forward.experts.{e}.w3.weight",
        "blk.{i}.ffn_down_exps.weight": "model.layers.{i}.feed_forward.experts.{e}.w2.weight",
    },
}
#: tensors that are no HF tensor: llama-3's RoPE factors, Phi-3's longrope factors (read into the config)
NOT_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
#: GGUF tensors whose rows llama.cpp permuted, -> the config key of their head count
PERMUTED = {"attn_q": "num_attention_heads", "attn_k": "num_key_value_heads"}

_BLOCK = re.compile(r"blk\.(\d+)\.")


def _lookup(table: dict[str, str], gguf_name: str) -> str | None:
    match = _BLOCK.match(gguf_name)
    key = _BLOCK.sub("blk.{i}.", gguf_name, count=1) if match else gguf_name
    hf = table.get(key)
    return None if hf is None else hf.replace("{i}", match.group(1) if match else "")


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF name of a GGUF tensor of ``arch`` (``general.architecture``), None for one the tables
    do not know."""
    return _lookup(ARCH_TENSORS.get(arch, {}), gguf_name) or _lookup(TENSORS, gguf_name)


def expert_names(gguf_name: str, experts: int, arch: str = "") -> list[str] | None:
    """The HF names of the experts a stacked GGUF tensor holds, in order; None if it holds none."""
    hf = _lookup(ARCH_EXPERTS.get(arch, EXPERTS), gguf_name)
    return None if hf is None else [hf.replace("{e}", str(e)) for e in range(experts)]


def _part(gguf_name: str) -> str:
    """A block tensor's name within the block, without ``.weight`` / ``.bias`` ("" outside blocks)."""
    match = _BLOCK.match(gguf_name)
    return gguf_name[match.end():].rsplit(".", 1)[0] if match else ""


def permuted_heads(gguf_name: str) -> str | None:
    """The config key of the head count whose rows llama.cpp permuted in this tensor, if it did."""
    return PERMUTED.get(_part(gguf_name))


def unsqueezed_axis(gguf_name: str) -> int | None:
    """The axis HF's tensor has and the GGUF tensor lost (``UNSQUEEZED``), if any."""
    return UNSQUEEZED.get(_part(gguf_name))


def unpermute_order(rows: int, heads: int) -> list[int]:
    """For each HF row, the GGUF row holding it (the inverse of ``LlamaModel.permute``)."""
    half = rows // heads // 2
    return [h * 2 * half + i * 2 + j for h in range(heads) for j in range(2) for i in range(half)]
