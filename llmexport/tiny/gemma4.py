"""Tiny random Gemma4 checkpoints for tests, the demo and benchmarks.

Each shape mirrors one real family member's *structure* (which features are on, how the
layer types and KV sharing are laid out) at toy sizes, so that every code path of the
exporter runs in seconds. One-dimensional weights (norm gammas, ``layer_scalar``, router
scales) are randomised away from 1: an exporter that forgets one of them is visibly wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from llmexport.tiny.tokenizer import SPECIAL_TOKENS, build_tiny_gemma_tokenizer

TINY_VOCAB = 512


@dataclass(frozen=True)
class TinyGemma4Shape:
    """Structural description of one tiny Gemma4 variant."""

    name: str
    layer_types: tuple[str, ...]
    text_overrides: dict[str, Any] = field(default_factory=dict)


_S, _F = "sliding_attention", "full_attention"

SHAPES: dict[str, TinyGemma4Shape] = {
    # PLE, KV sharing with a sliding and a full source layer, global_head_dim != head_dim,
    # double-wide MLP on shared layers, final logit softcapping.
    "e2b": TinyGemma4Shape(
        "e2b",
        (_S, _S, _F, _S, _S, _S, _S, _F),
        dict(num_kv_shared_layers=3, use_double_wide_mlp=True, hidden_size_per_layer_input=16,
             final_logit_softcapping=30.0),
    ),
    # PLE and KV sharing, no double-wide MLP.
    "e4b": TinyGemma4Shape(
        "e4b",
        (_S, _S, _S, _F, _S, _S, _F, _S, _S, _S, _S, _F),
        dict(num_kv_shared_layers=4, hidden_size_per_layer_input=8, num_key_value_heads=1,
             final_logit_softcapping=30.0),
    ),
    # K=V on full layers, different KV head counts per layer type, no PLE, untied lm_head.
    "31b": TinyGemma4Shape(
        "31b",
        (_S, _S, _F, _S, _S, _F),
        dict(attention_k_eq_v=True, num_global_key_value_heads=1, hidden_size_per_layer_input=0,
             tie_word_embeddings=False, final_logit_softcapping=30.0),
    ),
    # Dense MLP in parallel with a routed MoE, K=V on full layers.
    "26b-a4b": TinyGemma4Shape(
        "26b-a4b",
        (_S, _S, _F, _S, _S, _F),
        dict(attention_k_eq_v=True, num_global_key_value_heads=1, hidden_size_per_layer_input=0,
             enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32,
             final_logit_softcapping=30.0),
    ),
}


def text_config_dict(shape: TinyGemma4Shape) -> dict[str, Any]:
    """The text-config keyword arguments of a tiny shape."""
    config: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        vocab_size_per_layer_input=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=len(shape.layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        layer_types=list(shape.layer_types),
        sliding_window=8,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        pad_token_id=SPECIAL_TOKENS["pad"][1],
        bos_token_id=SPECIAL_TOKENS["bos"][1],
        eos_token_id=SPECIAL_TOKENS["eos"][1],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                               "rope_theta": 1_000_000.0},
        },
    )
    config.update(shape.text_overrides)
    return config


def randomize_vectors(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Move every 1-D parameter/buffer (gammas, scalars) away from its init of 1 or 0."""
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if tensor.dim() != 1 or not tensor.is_floating_point() or "inv_freq" in name:
                continue
            if name.endswith("embed_scale"):
                continue
            noise = torch.rand(tensor.shape, generator=generator) * 0.8 + 0.6  # in [0.6, 1.4]
            tensor.copy_(noise.to(tensor.dtype))


def randomize_gemma(model: torch.nn.Module, seed: int) -> torch.Generator:
    """Matrices N(0, 0.05^2), then the 1-D weights as ``randomize_vectors``; returns the generator
    (seeded ``seed + 1``) for further draws."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, param in model.named_parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    randomize_vectors(model, generator)
    return generator


def build_tiny_gemma4(
    out_dir: Path | str,
    shape: str = "e2b",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    text_only: bool = False,
) -> Path:
    """Write a random-weight Gemma4 checkpoint of one of ``SHAPES`` to ``out_dir``.

    ``text_only`` writes a ``gemma4_text`` / ``Gemma4ForCausalLM`` checkpoint; otherwise the
    multimodal-style ``gemma4`` / ``Gemma4ForConditionalGeneration`` layout real checkpoints use
    (without vision/audio towers).
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown tiny Gemma4 shape {shape!r}; choose from {sorted(SHAPES)}")
    return build_gemma4_checkpoint(out_dir, text_config_dict(SHAPES[shape]), seed=seed, dtype=dtype,
                                   text_only=text_only)


def build_gemma4_checkpoint(
    out_dir: Path | str,
    text_kwargs: dict[str, Any],
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    text_only: bool = False,
    vision_config: dict[str, Any] | None = None,
    audio_config: dict[str, Any] | None = None,
    tokenizer_corpus: str | None = None,
) -> Path:
    """Write a random-weight Gemma4 checkpoint for arbitrary text-config keyword arguments
    (and optional vision/audio tower configs, multimodal layout only; ``tokenizer_corpus``: the
    text its tokenizer learns on, default the embedded one)."""
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    text_config = Gemma4TextConfig(**text_kwargs)
    model: Gemma4ForCausalLM | Gemma4ForConditionalGeneration
    if text_only:
        model = Gemma4ForCausalLM(text_config)
    else:
        ids = {name: SPECIAL_TOKENS[name][1] for name in SPECIAL_TOKENS}
        config = Gemma4Config(text_config=text_config.to_dict(), vision_config=vision_config,
                              audio_config=audio_config, tie_word_embeddings=text_config.tie_word_embeddings,
                              boi_token_id=ids["boi"], eoi_token_id=ids["eoi"], image_token_id=ids["image"],
                              boa_token_id=ids["boa"], eoa_token_index=ids["eoa"], audio_token_id=ids["audio"],
                              video_token_id=ids["video"])
        model = Gemma4ForConditionalGeneration(config)
    randomize_gemma(model, seed)
    cast(nn.Module, model).to(dtype)  # in place (transformers types its own `to` too loosely to check)
    model.save_pretrained(out, safe_serialization=True)
    build_tiny_gemma_tokenizer(out, vocab_size=text_config.vocab_size, corpus=tokenizer_corpus)
    write_generation_config(out)
    return out


def write_generation_config(out: Path) -> None:
    path = out / "generation_config.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(bos_token_id=SPECIAL_TOKENS["bos"][1], eos_token_id=SPECIAL_TOKENS["eos"][1],
                pad_token_id=SPECIAL_TOKENS["pad"][1], do_sample=False)
    path.write_text(json.dumps(data, indent=2))


def trained_text_config(vocab_size: int) -> dict[str, Any]:
    """An E2B-like shape of 6M parameters, for models trained on real text
    (llmexport.tiny.trained): E2B's layer pattern (four sliding layers per full one), its last layers
    sharing KV, one KV head, double-wide MLPs on the shared layers, per-layer embeddings, a
    global head_dim twice the sliding one, final logit softcapping; a sliding window shorter than
    the training and scoring windows."""
    return dict(text_config_dict(SHAPES["e2b"]), vocab_size=vocab_size, vocab_size_per_layer_input=vocab_size,
                hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=1,
                head_dim=64, global_head_dim=128, hidden_size_per_layer_input=32, sliding_window=64,
                layer_types=[_S, _S, _S, _F, _S, _S, _S, _F], num_kv_shared_layers=3)
