"""Tiny random K2-Horizon checkpoints for tests, the demo and benchmarks.

A checkpoint folder holds what a real one does: ``config.json`` with ``auto_map`` pointing at the
remote-code files copied beside it (``configuration_k2_horizon.py``, ``modeling_k2_horizon.py``
from ``llmexport.reference.k2_horizon``), ``model.safetensors`` in the schema of
docs/k2-horizon.md, and a tokenizer.

The tokenizer is the tiny trained one of ``llmexport.tiny.tokenizer`` (Gemma-style special
tokens). Real K2-Horizon checkpoints think inside ``<ifm|think> ... </ifm|think>`` and their
template takes ``reasoning_effort``; the tiny checkpoints use a plain turn template instead
(``PLAIN_CHAT_TEMPLATE``), which is all verification needs (a chat-templated prompt).

Weights (llmexport.tiny.weights): matrices N(0, 0.15); one-dimensional weights (norm gammas) are randomised away from 1
so a forgotten gamma shows; router ``e_score_correction_bias`` values are random and large
enough that the biased choice differs from the unbiased one for many tokens.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from llmexport.tiny.byte_level_tokenizer import write_checkpoint_tokenizer, write_generation_config
from llmexport.tiny.tokenizer import SPECIAL_TOKENS, build_tiny_gemma_tokenizer
from llmexport.tiny.weights import randomize

TINY_VOCAB = 512
ROUTER_BIAS_RANGE = 0.25  # uniform in [-r, r]; the tiny routers' sigmoid scores spread about 0.2

PLAIN_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|turn>{{ message['role'] }}\n{{ message['content'] }}<turn|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|turn>assistant\n{% endif %}"
)

_SPARSE = dict(mlp_only_layers=[], decoder_sparse_step=2, num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=32, num_shared_experts=2, mova_num_experts=8, mova_top_k=2,
               scoring_func="sigmoid", norm_topk_prob=True, router_scaling_factor=2.5)

# name -> config overrides on top of ``base_config()``
VARIANTS: dict[str, dict[str, Any]] = {
    # the 3.7B's structure: every layer dense, no experts, untied embeddings
    "dense": dict(mlp_only_layers=[0, 1, 2, 3], tie_word_embeddings=False, rope_parameters={
        "rope_type": "default", "rope_theta": 10_000_000.0}),
    # MoE FFN + MoVA attention on layers 1 and 3 (decoder_sparse_step 2), shared experts
    "sparse": dict(_SPARSE),
    # the same with per-head q/k GroupedRMSNorm, MoVA router with its own top-k/normalisation
    "sparse-qknorm": dict(_SPARSE, query_key_norm=True, mova_top_k=3, mova_norm_topk_prob=False,
                          mova_router_scaling_factor=1.0),
}


def base_config() -> dict[str, Any]:
    return dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
        max_position_embeddings=4096, rms_norm_eps=1e-6, layernorm_num_groups=2, query_key_norm=False,
        attention_bias=False, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        tie_word_embeddings=True, pad_token_id=SPECIAL_TOKENS["pad"][1], bos_token_id=SPECIAL_TOKENS["bos"][1],
        eos_token_id=SPECIAL_TOKENS["eos"][1],
    )


def variant_config(name: str) -> dict[str, Any]:
    if name not in VARIANTS:
        raise ValueError(f"unknown tiny K2-Horizon variant {name!r}; choose from {sorted(VARIANTS)}")
    return {**base_config(), **VARIANTS[name]}


def random_config(seed: int) -> dict[str, Any]:
    """A seeded random point of the family's configuration space (tests of the rewrite)."""
    rng = random.Random(seed)
    n = rng.randint(2, 5)
    heads = rng.choice([2, 4])
    hidden = rng.choice([32, 48, 64])
    config = {**base_config(), **dict(
        num_hidden_layers=n, hidden_size=hidden, intermediate_size=rng.choice([40, 64]),
        num_attention_heads=heads, num_key_value_heads=rng.choice([d for d in (1, 2, 4) if heads % d == 0]),
        head_dim=rng.choice([8, 16]), layernorm_num_groups=rng.choice([g for g in (1, 2, 4) if hidden % g == 0]),
        query_key_norm=rng.random() < 0.5, attention_bias=rng.random() < 0.3,
        tie_word_embeddings=rng.random() < 0.5, rms_norm_eps=rng.choice([1e-6, 1e-5]),
        rope_parameters={"rope_type": "default", "rope_theta": rng.choice([10_000.0, 1e6, 1e7])},
    )}
    if rng.random() < 0.8:
        experts = rng.choice([4, 6])
        config.update(
            num_experts=experts, num_experts_per_tok=rng.randint(1, 3), moe_intermediate_size=16,
            num_shared_experts=rng.choice([0, 1, 2]), decoder_sparse_step=rng.choice([1, 2]),
            mlp_only_layers=sorted(rng.sample(range(n), rng.randint(0, 1))),
            scoring_func=rng.choice(["sigmoid", "softmax"]), norm_topk_prob=rng.random() < 0.6,
            router_scaling_factor=rng.choice([1.0, 2.5]))
        if rng.random() < 0.75:
            mova = rng.choice([4, 8])
            config.update(mova_num_experts=mova, mova_top_k=rng.randint(1, 3),
                          mova_norm_topk_prob=rng.choice([None, True, False]),
                          mova_router_scaling_factor=rng.choice([None, 1.0, 1.5]))
    return config


def build_k2_horizon_checkpoint(out_dir: Path | str, config_kwargs: dict[str, Any], *, seed: int = 0,
                                dtype: torch.dtype = torch.bfloat16, tokenizer: str = "gemma") -> Path:
    """Write a random-weight K2-Horizon checkpoint (remote code, weights, tokenizer) to ``out_dir``.

    bf16 by default, as the family ships: a ``--quant_bit 16`` export then stores the weights
    exactly (bf16 values are fp16 values at these magnitudes), so the runtime can be held to the
    unmodified fp32 reference too, not only to the stored-weights oracle. ``tokenizer``: "gemma"
    (the tiny Gemma-style one) or a byte-level style of ``llmexport.tiny.byte_level_tokenizer``
    ("qwen": Qwen's ByteLevel BPE and ChatML template).
    """
    from llmexport.reference.k2_horizon import AUTO_MAP, REMOTE_CODE_FILES, K2HorizonConfig, K2HorizonForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    token_ids: dict[str, int | list[int] | None] = {}
    if tokenizer != "gemma":
        token_ids = write_checkpoint_tokenizer(out, tokenizer, config_kwargs["vocab_size"])
        config_kwargs = {**config_kwargs, **token_ids}
    torch.manual_seed(seed)
    model = K2HorizonForCausalLM(K2HorizonConfig(**config_kwargs)).eval()
    randomize(model, torch.Generator().manual_seed(seed + 1), ROUTER_BIAS_RANGE)
    # the router bias stays fp32 whatever the checkpoint dtype (published numerics)
    biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    model = model.to(dtype)
    for name, bias in biases.items():
        model.get_submodule(name.rsplit(".", 1)[0]).e_score_correction_bias = bias
    model.save_pretrained(out, safe_serialization=True)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = dict(AUTO_MAP)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for source in REMOTE_CODE_FILES:
        shutil.copyfile(source, out / source.name)
    if tokenizer == "gemma":
        build_tiny_gemma_tokenizer(out, vocab_size=config["vocab_size"])
        (out / "chat_template.jinja").write_text(PLAIN_CHAT_TEMPLATE, encoding="utf-8")
        (out / "generation_config.json").write_text(json.dumps(dict(
            bos_token_id=SPECIAL_TOKENS["bos"][1],
            eos_token_id=[SPECIAL_TOKENS["eos"][1], SPECIAL_TOKENS["end_of_turn"][1]],
            pad_token_id=SPECIAL_TOKENS["pad"][1], do_sample=False), indent=2))
    else:
        write_generation_config(out, token_ids)
    return out


def build_tiny_k2_horizon(out_dir: Path | str, variant: str = "sparse", *, seed: int = 0,
                          dtype: torch.dtype = torch.bfloat16, tokenizer: str = "gemma") -> Path:
    """Write one of ``VARIANTS`` as a tiny random checkpoint to ``out_dir`` (``tokenizer``: see
    ``build_k2_horizon_checkpoint``)."""
    return build_k2_horizon_checkpoint(out_dir, variant_config(variant), seed=seed, dtype=dtype, tokenizer=tokenizer)
