"""Tiny random Qwen3.5 checkpoints of all four model types, built with transformers' own classes.

``qwen3_5`` / ``qwen3_5_moe`` are the released layout (``Qwen3_5ForConditionalGeneration`` /
``Qwen3_5MoeForConditionalGeneration``: the text model under ``model.language_model.``, a tiny
vision tower under ``model.visual.``, exported as ``visual.mnn``); ``qwen3_5_text`` / ``qwen3_5_moe_text`` are what
``AutoModelForCausalLM`` saves (``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``);
``qwen3_5-moe-stacked`` stores its routed experts stacked, as mlx-lm's sanitize reads them. Every variant
mixes Gated DeltaNet (``linear_attention``) and gated full-attention layers, with more value heads
than key heads in the linear layers, partial rotary (0.25) and M-RoPE sections as released.
Qwen's ByteLevel BPE tokenizer with the ChatML template (llmexport.tiny.byte_level_tokenizer),
bf16 weights (llmexport.tiny.weights).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from llmexport.tiny.byte_level_tokenizer import write_checkpoint_tokenizer, write_generation_config
from llmexport.tiny.weights import save_random

TINY_VOCAB = 512


@dataclass(frozen=True)
class ModelType:
    model_class: str  # transformers class
    config_class: str
    multimodal: bool
    moe: bool


MODEL_TYPES: dict[str, ModelType] = {
    "qwen3_5": ModelType("Qwen3_5ForConditionalGeneration", "Qwen3_5Config", True, False),
    "qwen3_5_moe": ModelType("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeConfig", True, True),
    "qwen3_5_text": ModelType("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", False, False),
    "qwen3_5_moe_text": ModelType("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", False, True),
}

#: the text model: head_dim 32 with partial rotary 0.25 (8 rotated dims, M-RoPE sections of 4 pairs)
TEXT_BASE: dict[str, Any] = dict(
    vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6,
    tie_word_embeddings=False, attention_bias=False,
    layer_types=["linear_attention", "full_attention"] * 2,
    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True})
MOE: dict[str, Any] = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=48)
#: a tower small enough to cost little, in the released layout: patch 16 (the runtime's for this
#: tower), a 4x4 square of learned positions (the released 48x48), two blocks
VISION: dict[str, Any] = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                              patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)

# name -> (model type, text config overrides)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # the released dense layout: three linear layers per full layer (full_attention_interval 4 in
    # the real ones); here 4 layers, every second one full
    "qwen3_5": ("qwen3_5", {}),
    # tied embeddings (the small released sizes), full layer first
    "qwen3_5-tied": ("qwen3_5", dict(tie_word_embeddings=True,
                                     layer_types=["full_attention", "linear_attention", "linear_attention",
                                                  "full_attention"])),
    "qwen3_5-moe": ("qwen3_5_moe", dict(MOE)),
    # AutoModelForCausalLM's layout, a shorter conv kernel
    "qwen3_5-text": ("qwen3_5_text", dict(linear_conv_kernel_dim=3)),
    "qwen3_5-moe-text": ("qwen3_5_moe_text", dict(MOE, num_experts_per_tok=3, tie_word_embeddings=True)),
    # the released layout with its routed experts stored stacked (``restack_experts``)
    "qwen3_5-moe-stacked": ("qwen3_5_moe", dict(MOE, num_experts_per_tok=3)),
}
#: the variants saved with stacked experts
STACKED_VARIANTS = frozenset({"qwen3_5-moe-stacked"})
#: a per-expert tensor as save_pretrained writes it: (experts module, expert, projection)
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def variant_config(name: str) -> tuple[str, dict[str, Any]]:
    if name not in VARIANTS:
        raise ValueError(f"unknown tiny Qwen3.5 variant {name!r}; choose from {sorted(VARIANTS)}")
    model_type, overrides = VARIANTS[name]
    return model_type, {**TEXT_BASE, **overrides}


def random_config(model_type: str, seed: int) -> dict[str, Any]:
    """A seeded random point of the text configuration space (tests of the rewrite)."""
    rng = random.Random(seed)
    n = rng.randint(2, 4)
    heads = rng.choice([2, 4])
    k_heads = rng.choice([1, 2])
    head_dim = rng.choice([16, 32])
    factor = rng.choice([0.25, 0.5, 1.0])
    pairs = int(head_dim * factor) // 2
    h_pairs = rng.randint(0, pairs // 2)
    w_pairs = rng.randint(0, (pairs - h_pairs) // 2)
    kinds = [rng.choice(["linear_attention", "full_attention"]) for _ in range(n)]
    kinds[rng.randrange(n)] = "linear_attention"
    config = {**TEXT_BASE, **dict(
        num_hidden_layers=n, hidden_size=rng.choice([32, 48, 64]), intermediate_size=rng.choice([40, 64]),
        num_attention_heads=heads, num_key_value_heads=rng.choice([d for d in (1, 2, 4) if heads % d == 0]),
        head_dim=head_dim, tie_word_embeddings=rng.random() < 0.5, rms_norm_eps=rng.choice([1e-6, 1e-5]),
        layer_types=kinds, linear_conv_kernel_dim=rng.choice([2, 3, 4]), linear_key_head_dim=rng.choice([8, 16]),
        linear_value_head_dim=rng.choice([8, 16]), linear_num_key_heads=k_heads,
        linear_num_value_heads=k_heads * rng.choice([1, 2, 3]),
        rope_parameters={"rope_type": "default", "rope_theta": rng.choice([10_000.0, 1e7]),
                         "partial_rotary_factor": factor,
                         "mrope_section": [pairs - h_pairs - w_pairs, h_pairs, w_pairs], "mrope_interleaved": True})}
    if MODEL_TYPES[model_type].moe:
        config.update(num_experts=rng.choice([4, 6]), num_experts_per_tok=rng.randint(1, 3),
                      moe_intermediate_size=16, shared_expert_intermediate_size=rng.choice([16, 24]))
    return config


def vision_token_ids(tokenizer: Tokenizer) -> dict[str, int | None]:
    """The multimodal config's token ids of Qwen's vision tokens in the tiny tokenizer."""
    return {key: tokenizer.token_to_id(token) for key, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|vision_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}


def _config(model_type: str, text: dict[str, Any], token_ids: dict[str, Any], tokenizer: Tokenizer):
    import transformers

    spec = MODEL_TYPES[model_type]
    config_class = getattr(transformers, spec.config_class)
    if not spec.multimodal:
        return config_class(**text, **token_ids)
    text_class = getattr(transformers, spec.config_class.replace("Config", "TextConfig"))
    ids = vision_token_ids(tokenizer)
    tie = text.get("tie_word_embeddings", False)
    vision = dict(VISION, out_hidden_size=text["hidden_size"])  # the merger writes text embeddings
    return config_class(text_config=text_class(**text, **token_ids).to_dict(), vision_config=vision,
                        tie_word_embeddings=tie, **ids)


def build_qwen3_5_checkpoint(out_dir: Path | str, model_type: str, text: dict[str, Any], *, seed: int = 0,
                             dtype: torch.dtype = torch.bfloat16, tokenizer_corpus: str | None = None) -> Path:
    """Write a random-weight checkpoint of ``model_type`` (a key of ``MODEL_TYPES``) whose text
    model has the config ``text`` to ``out_dir`` (``tokenizer_corpus``: the text its tokenizer
    learns on; default the embedded one)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    token_ids = write_checkpoint_tokenizer(out, "qwen", text["vocab_size"], tokenizer_corpus)
    config = _config(model_type, text, token_ids, Tokenizer.from_file(str(out / "tokenizer.json")))
    save_random(MODEL_TYPES[model_type].model_class, config, out, seed, dtype)
    write_generation_config(out, token_ids)
    return out


def trained_config(vocab_size: int) -> tuple[str, dict[str, Any]]:
    """A text-only Qwen3.5 of about 1M parameters in the released pattern (three Gated DeltaNet
    layers per full-attention layer, tied embeddings), for models trained on real text
    (llmexport.tiny.trained): (model type, text config)."""
    return "qwen3_5_text", {**TEXT_BASE, **dict(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
        layer_types=["linear_attention"] * 3 + ["full_attention"], linear_key_head_dim=32,
        linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4)}


def restack_experts(checkpoint: Path) -> None:
    """Rewrite ``checkpoint``'s single ``model.safetensors`` with its routed experts stacked as
    transformers keeps them (Qwen3_5MoeExperts): ``experts.gate_up_proj`` [E, 2 * width, hidden]
    (each expert's gate rows, then its up rows) and ``experts.down_proj`` [E, hidden, width]."""
    from safetensors.torch import load_file, save_file

    path = checkpoint / "model.safetensors"
    tensors = load_file(str(path))
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name in [n for n in tensors if _PER_EXPERT.match(n)]:
        module, expert, proj = _PER_EXPERT.match(name).groups()  # type: ignore[union-attr]
        experts.setdefault(module, {}).setdefault(int(expert), {})[proj] = tensors.pop(name)
    for module, by_expert in experts.items():
        rows = [by_expert[e] for e in range(len(by_expert))]
        tensors[f"{module}.gate_up_proj"] = torch.stack([torch.cat([r["gate_proj"], r["up_proj"]]) for r in rows])
        tensors[f"{module}.down_proj"] = torch.stack([r["down_proj"] for r in rows])
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path), metadata={"format": "pt"})


def build_tiny_qwen3_5(out_dir: Path | str, variant: str, *, seed: int = 0,
                       dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write one of ``VARIANTS`` as a tiny random checkpoint to ``out_dir`` (``STACKED_VARIANTS``
    with their routed experts stacked)."""
    model_type, text = variant_config(variant)
    out = build_qwen3_5_checkpoint(out_dir, model_type, text, seed=seed, dtype=dtype)
    if variant in STACKED_VARIANTS:
        restack_experts(out)
    return out
