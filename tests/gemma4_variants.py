"""Seeded random Gemma4 text configurations spanning the family's feature space."""

from __future__ import annotations

import random
from typing import Any

from llmexport.tiny.gemma4 import TINY_VOCAB
from llmexport.tiny.tokenizer import SPECIAL_TOKENS

S, F = "sliding_attention", "full_attention"


def random_text_config(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    n = rng.randint(2, 7)
    types = [rng.choice([S, S, F]) for _ in range(n - 1)] + [F]
    shared = 0
    if n >= 3 and rng.random() < 0.6:
        k = rng.randint(1, n - 2)
        if set(types[n - k:]) <= set(types[: n - k]):
            shared = k
    heads = rng.choice([2, 4])
    kv_heads = rng.choice([d for d in (1, 2, 4) if heads % d == 0])
    k_eq_v = rng.random() < 0.4
    moe = rng.random() < 0.3
    config: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB, vocab_size_per_layer_input=TINY_VOCAB,
        hidden_size=rng.choice([32, 48]), intermediate_size=rng.choice([40, 64]),
        num_hidden_layers=n, layer_types=types, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=rng.choice([8, 16]), global_head_dim=rng.choice([16, 32]),
        num_kv_shared_layers=shared, use_double_wide_mlp=rng.random() < 0.5,
        sliding_window=rng.choice([4, 6, 8]), attention_k_eq_v=k_eq_v,
        hidden_size_per_layer_input=rng.choice([0, 4, 8]),
        final_logit_softcapping=rng.choice([None, 30.0]), tie_word_embeddings=rng.random() < 0.6,
        max_position_embeddings=2048, rms_norm_eps=rng.choice([1e-6, 1e-5]),
        pad_token_id=SPECIAL_TOKENS["pad"][1], bos_token_id=SPECIAL_TOKENS["bos"][1],
        eos_token_id=SPECIAL_TOKENS["eos"][1],
        rope_parameters={
            S: {"rope_type": "default", "rope_theta": rng.choice([10_000.0, 50_000.0])},
            F: {"rope_type": "proportional", "partial_rotary_factor": rng.choice([0.25, 0.5, 1.0]),
                "rope_theta": 1_000_000.0},
        },
    )
    if k_eq_v:
        config["num_global_key_value_heads"] = rng.choice([d for d in (1, 2) if heads % d == 0])
    if moe:
        config.update(enable_moe_block=True, num_experts=rng.choice([4, 6]), top_k_experts=rng.choice([1, 2]),
                      moe_intermediate_size=16)
    return config
