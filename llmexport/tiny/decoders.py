"""Tiny random Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral, Ministral and SmolLM3 checkpoints, built
with transformers' own classes.

Each holds what a real checkpoint does: ``config.json`` and ``model.safetensors`` as
``save_pretrained`` writes them (Qwen3-MoE experts one tensor per expert, the hub layout), the
family's tokenizer style (llmexport.tiny.byte_level_tokenizer: Llama-3's for Llama, Mistral and Ministral
(a byte-level BPE, as Mistral-Nemo's tekken), Qwen's ByteLevel BPE with NFC and the ChatML
template for Qwen2/Qwen3/Qwen3-MoE and SmolLM3) and generation_config.json
with the style's eos ids. bf16 weights (llmexport.tiny.weights), as these families ship.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmexport.tiny.byte_level_tokenizer import write_checkpoint_tokenizer, write_generation_config
from llmexport.tiny.weights import save_random

TINY_VOCAB = 512
# Llama 3.1's RoPE: theta 5e5, frequencies rescaled beyond an 8192-token original context (all three
# bands of the rescaling occur at head_dim 16).
#: a window shorter than the parity prompts (21 and 13 tokens) and the verification's prompt, so a
#: wrong sliding mask shows
TINY_WINDOW = 6
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class Family:
    model_class: str  # transformers class
    config_class: str
    tokenizer: str  # llmexport.tiny.byte_level_tokenizer style
    base: dict[str, Any]


_COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
               max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False)
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
            mlp_only_layers=[], norm_topk_prob=True)

FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", "LlamaConfig", "llama3",
                    dict(_COMMON, rope_parameters=dict(LLAMA3_ROPE), max_position_embeddings=131072)),
    "qwen3": Family("Qwen3ForCausalLM", "Qwen3Config", "qwen",
                    dict(_COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})),
    "qwen2": Family("Qwen2ForCausalLM", "Qwen2Config", "qwen",
                    dict(_COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})),
    "mistral": Family("MistralForCausalLM", "MistralConfig", "llama3",
                      dict(_COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                           sliding_window=TINY_WINDOW)),
    "ministral": Family("MinistralForCausalLM", "MinistralConfig", "llama3",
                        dict(_COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                             sliding_window=TINY_WINDOW)),
    # SmolLM3: a Llama-3 vocabulary with ChatML turns; the tiny one takes the Qwen (ChatML) style
    "smollm3": Family("SmolLM3ForCausalLM", "SmolLM3Config", "qwen",
                      dict(_COMMON, rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0},
                           no_rope_layer_interval=2)),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", "Qwen3MoeConfig", "qwen",
                        dict(_COMMON, **_MOE, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})),
}

# name -> (family, config overrides)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # Llama 3.1-style: llama3 RoPE scaling, untied embeddings
    "llama3": ("llama", {}),
    # Llama 3.2-style small model: tied embeddings; plus q/k/v/o biases and default RoPE
    "llama3-tied": ("llama", dict(tie_word_embeddings=True, attention_bias=True,
                                  rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    # Qwen2 with sliding layers 2-3 (use_sliding_window, max_window_layers); q/k/v biases always
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=TINY_WINDOW, max_window_layers=2)),
    # Qwen2.5-0.5B-style: tied embeddings, full attention
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    # every layer sliding (Mistral 7B v0.1's config)
    "mistral": ("mistral", {}),
    # sliding and full layers interleaved (layer_types listed)
    "ministral": ("ministral", dict(layer_types=["sliding_attention", "full_attention"] * 2)),
    "qwen3": ("qwen3", {}),
    # Qwen3 with sliding layers 1-3 (use_sliding_window, max_window_layers)
    "qwen3-sliding": ("qwen3", dict(use_sliding_window=True, sliding_window=TINY_WINDOW, max_window_layers=1)),
    # NoPE on layers 1 and 3 (no_rope_layer_interval 2), attention biases
    "smollm3": ("smollm3", dict(attention_bias=True)),
    # NoPE layers 0 and 2 listed, and sliding (use_sliding_window makes the NoPE layers slide)
    "smollm3-sliding": ("smollm3", dict(no_rope_layers=[0, 1, 0, 1], use_sliding_window=True,
                                        sliding_window=TINY_WINDOW, tie_word_embeddings=True)),
    # Qwen3-0.6B-style tied embeddings, with attention biases
    "qwen3-tied": ("qwen3", dict(tie_word_embeddings=True, attention_bias=True)),
    # every layer sparse, renormalised top-k (Qwen3-30B-A3B's settings)
    "qwen3-moe": ("qwen3_moe", {}),
    # every layer sliding (use_sliding_window), with a dense layer 0
    "qwen3-moe-sliding": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=TINY_WINDOW, mlp_only_layers=[0])),
    # dense layer 0 (mlp_only_layers), sparse every second layer otherwise, no renormalisation
    "qwen3-moe-mixed": ("qwen3_moe", dict(mlp_only_layers=[0], decoder_sparse_step=2, norm_topk_prob=False,
                                          num_experts_per_tok=3)),
}


def variant_config(name: str) -> tuple[str, dict[str, Any]]:
    if name not in VARIANTS:
        raise ValueError(f"unknown tiny decoder variant {name!r}; choose from {sorted(VARIANTS)}")
    family, overrides = VARIANTS[name]
    return family, {**FAMILIES[family].base, **overrides}


def random_config(family: str, seed: int) -> dict[str, Any]:
    """A seeded random point of a family's configuration space (tests of the rewrite)."""
    rng = random.Random(seed)
    heads = rng.choice([2, 4])
    config = {**FAMILIES[family].base, **dict(
        num_hidden_layers=rng.randint(2, 4), hidden_size=rng.choice([32, 48, 64]),
        intermediate_size=rng.choice([40, 64]), num_attention_heads=heads,
        num_key_value_heads=rng.choice([d for d in (1, 2, 4) if heads % d == 0]), head_dim=rng.choice([8, 16]),
        tie_word_embeddings=rng.random() < 0.5, attention_bias=rng.random() < 0.3,
        rms_norm_eps=rng.choice([1e-6, 1e-5]))}
    if family == "llama" and rng.random() < 0.5:
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": rng.choice([10_000.0, 500_000.0])}
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        config.update(use_sliding_window=rng.random() < 0.7, sliding_window=rng.choice([3, 6]),
                      max_window_layers=rng.randint(0, config["num_hidden_layers"]))
    if family == "mistral":
        config["sliding_window"] = rng.choice([None, 3, 6])
    if family == "ministral":
        config.update(sliding_window=rng.choice([3, 6]), layer_types=[
            rng.choice(["sliding_attention", "full_attention"]) for _ in range(config["num_hidden_layers"])])
    if family == "smollm3":
        config.update(no_rope_layer_interval=rng.choice([2, 3, 4]), use_sliding_window=rng.random() < 0.5,
                      sliding_window=rng.choice([3, 6]))
    if family == "qwen3_moe":
        experts = rng.choice([4, 6])
        config.update(num_experts=experts, num_experts_per_tok=rng.randint(1, 3), moe_intermediate_size=16,
                      decoder_sparse_step=rng.choice([1, 2]), norm_topk_prob=rng.random() < 0.5,
                      mlp_only_layers=sorted(rng.sample(range(config["num_hidden_layers"]), rng.randint(0, 1))))
    return config


def build_decoder_checkpoint(out_dir: Path | str, family: str, config_kwargs: dict[str, Any], *, seed: int = 0,
                             dtype: torch.dtype = torch.bfloat16, tokenizer_corpus: str | None = None) -> Path:
    """Write a random-weight checkpoint of ``family`` (a key of ``FAMILIES``) to ``out_dir``
    (``tokenizer_corpus``: the text its tokenizer learns on; default the embedded one)."""
    import transformers

    spec = FAMILIES[family]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    token_ids = write_checkpoint_tokenizer(out, spec.tokenizer, config_kwargs["vocab_size"], tokenizer_corpus)
    config = getattr(transformers, spec.config_class)(**config_kwargs, **token_ids)
    save_random(spec.model_class, config, out, seed, dtype)
    write_generation_config(out, token_ids)
    return out


def build_tiny_decoder(out_dir: Path | str, variant: str, *, seed: int = 0,
                       dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write one of ``VARIANTS`` as a tiny random checkpoint to ``out_dir``."""
    family, config = variant_config(variant)
    return build_decoder_checkpoint(out_dir, family, config, seed=seed, dtype=dtype)


def trained_config(vocab_size: int) -> tuple[str, dict[str, Any]]:
    """A Llama-3.2-like decoder of 5.2M parameters (tied embeddings, default RoPE), for models
    trained on real text (llmexport.tiny.trained): (family, config keyword arguments)."""
    family, config = variant_config("llama3-tied")
    return family, dict(config, vocab_size=vocab_size, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, attention_bias=False)
