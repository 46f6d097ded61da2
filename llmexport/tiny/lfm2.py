"""Tiny random LFM2 / LFM2-MoE checkpoints (``lfm2``, ``lfm2_moe``), built with transformers' own
classes (``Lfm2ForCausalLM``, ``Lfm2MoeForCausalLM``) and written by ``save_pretrained`` (LFM2-MoE's
experts one tensor per expert, as the hub keeps them).

Short-conv and attention layers interleaved, tied embeddings (LFM2's default), a tokenizer laid
out as the released ones (llmexport.tiny.byte_level_tokenizer's ``lfm2`` style: ``<|startoftext|>``
as bos, ``<|im_end|>`` as eos, LFM2's special tokens and its real chat template), bf16 weights
(llmexport.tiny.weights) with selection biases large enough to change which experts are chosen.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from llmexport.tiny.byte_level_tokenizer import write_checkpoint_tokenizer, write_generation_config
from llmexport.tiny.weights import randomize

TINY_VOCAB = 512
TOKENIZER_STYLE = "lfm2"
#: uniform range of the tiny MoE's ``expert_bias`` (sigmoid scores lie in (0, 1))
EXPERT_BIAS_RANGE = 0.3

_COMMON: dict[str, Any] = dict(
    vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=4096, norm_eps=1e-5, conv_L_cache=3, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    layer_types=["conv", "full_attention", "conv", "full_attention"])

#: name -> (model_type, config keyword arguments)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # LFM2-350M-like: the MLP width adjusted from intermediate_size (2/3, x multiplier, multiple of)
    "dense": ("lfm2", dict(_COMMON, intermediate_size=144, block_auto_adjust_ff_dim=True,
                           block_ffn_dim_multiplier=1.0, block_multiple_of=32)),
    # conv kernel 4, attention at layers 0 and 2 given as full_attn_idxs, untied head, width as given
    "dense-idxs": ("lfm2", dict(_COMMON, layer_types=None, full_attn_idxs=[0, 2], conv_L_cache=4,
                                tie_word_embeddings=False, intermediate_size=96, block_auto_adjust_ff_dim=False)),
    # LFM2-8B-A1B-like: one dense layer, then routed experts, renormalised, expert_bias
    "moe": ("lfm2_moe", dict(_COMMON, intermediate_size=96, moe_intermediate_size=32, num_dense_layers=1,
                             num_experts=8, num_experts_per_tok=2, use_expert_bias=True, norm_topk_prob=True,
                             routed_scaling_factor=1.0)),
    # no expert_bias, no renormalisation, a routed scale
    "moe-plain": ("lfm2_moe", dict(_COMMON, intermediate_size=96, moe_intermediate_size=32, num_dense_layers=2,
                                   num_experts=6, num_experts_per_tok=3, use_expert_bias=False,
                                   norm_topk_prob=False, routed_scaling_factor=1.5)),
}
_CLASSES = {"lfm2": ("Lfm2Config", "Lfm2ForCausalLM"), "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM")}


def random_config(seed: int) -> tuple[str, dict[str, Any]]:
    """A seeded random point of the family's configuration space: (model_type, config)."""
    rng = random.Random(seed)
    n = rng.randint(2, 4)
    heads = rng.choice([2, 4])
    kinds = [rng.choice(["conv", "full_attention"]) for _ in range(n)]
    attention, conv = rng.sample(range(n), 2)  # LFM2 always has both kinds
    kinds[attention], kinds[conv] = "full_attention", "conv"
    config = dict(_COMMON, num_hidden_layers=n, hidden_size=rng.choice([32, 48, 64]), num_attention_heads=heads,
                  num_key_value_heads=rng.choice([d for d in (1, 2, 4) if heads % d == 0]),
                  conv_L_cache=rng.choice([2, 3, 4]), tie_word_embeddings=rng.random() < 0.6,
                  norm_eps=rng.choice([1e-5, 1e-6]), layer_types=kinds,
                  rope_parameters={"rope_type": "default", "rope_theta": rng.choice([10_000.0, 1_000_000.0])})
    if rng.random() < 0.5:
        return "lfm2", dict(config, intermediate_size=rng.choice([96, 144]),
                            block_auto_adjust_ff_dim=rng.random() < 0.5, block_multiple_of=rng.choice([8, 16]),
                            block_ffn_dim_multiplier=rng.choice([1.0, 1.5]))
    experts = rng.choice([4, 6])
    return "lfm2_moe", dict(config, intermediate_size=rng.choice([40, 64]), moe_intermediate_size=16,
                            num_dense_layers=rng.randint(0, n - 1), num_experts=experts,
                            num_experts_per_tok=rng.randint(1, 3), use_expert_bias=rng.random() < 0.7,
                            norm_topk_prob=rng.random() < 0.6, routed_scaling_factor=rng.choice([1.0, 2.5]))


def build_lfm2_checkpoint(out_dir: Path | str, model_type: str, config_kwargs: dict[str, Any], *, seed: int = 0,
                          dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a random-weight checkpoint of ``model_type`` ("lfm2" or "lfm2_moe") to ``out_dir``."""
    import transformers

    config_class, model_class = _CLASSES[model_type]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    token_ids = write_checkpoint_tokenizer(out, TOKENIZER_STYLE, config_kwargs["vocab_size"])
    config = getattr(transformers, config_class)(**config_kwargs, **token_ids)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    randomize(model, torch.Generator().manual_seed(seed + 1), router_bias_range=EXPERT_BIAS_RANGE)
    model.to(dtype).save_pretrained(out, safe_serialization=True)
    write_generation_config(out, token_ids)
    return out


def build_tiny_lfm2(out_dir: Path | str, variant: str = "dense", *, seed: int = 0,
                    dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write one of ``VARIANTS`` as a tiny random checkpoint to ``out_dir``."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown tiny LFM2 variant {variant!r}; choose from {sorted(VARIANTS)}")
    model_type, config = VARIANTS[variant]
    return build_lfm2_checkpoint(out_dir, model_type, config, seed=seed, dtype=dtype)
