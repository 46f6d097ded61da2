"""Tiny random Gemma3 checkpoints: text-only (``gemma3_text``, ``Gemma3ForCausalLM``) and
multimodal (``gemma3``, ``Gemma3ForConditionalGeneration``: a tiny SigLIP tower and projector).

The structure of Gemma 3 270M / 1B at toy sizes: five sliding layers to one full (here a short
pattern), a sliding window shorter than the verification prompts, two RoPE bases,
``query_pre_attn_scalar`` != head_dim, tied embeddings. Norm weights are moved away from their
zero init (Gemma's norm is 1 + weight), as Gemma4's tiny builder does.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from llmexport.tiny.gemma4 import randomize_gemma, write_generation_config
from llmexport.tiny.tokenizer import SPECIAL_TOKENS, build_tiny_gemma_tokenizer

TINY_VOCAB = 512
_S, _F = "sliding_attention", "full_attention"
# Gemma 3's turn format (its bos, roles, turn markers), without its ``| trim`` of the content: the
# runtime's trim strips only ASCII whitespace, Python's all (docs/chat-templates.md), and a random
# model's replies can end in U+00A0
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

BASE: dict[str, Any] = dict(
    vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
    layer_types=[_S, _S, _F, _S], max_position_embeddings=4096, rms_norm_eps=1e-6,
    rope_parameters={_S: {"rope_type": "default", "rope_theta": 10_000.0},
                     _F: {"rope_type": "default", "rope_theta": 1_000_000.0}},
    pad_token_id=SPECIAL_TOKENS["pad"][1], bos_token_id=SPECIAL_TOKENS["bos"][1],
    eos_token_id=SPECIAL_TOKENS["eos"][1], tie_word_embeddings=True,
)

VARIANTS: dict[str, dict[str, Any]] = {
    # Gemma 3 270M / 1B: tied embeddings, default RoPE on both layer types
    "1b": {},
    # Gemma 3 4B-style linear RoPE scaling on full layers, untied head, final logit softcapping, biases
    "scaled": dict(rope_parameters={_S: {"rope_type": "default", "rope_theta": 10_000.0},
                                    _F: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}},
                   tie_word_embeddings=False, final_logit_softcapping=30.0, attention_bias=True,
                   layer_types=[_S, _F, _S, _F], num_key_value_heads=2),
    # no sliding layers: the plain one-slice mask
    "full": dict(layer_types=[_F] * 3, num_hidden_layers=3),
}


#: a tiny SigLIP tower: 64x64 images, 8x8 patches (an 8x8 grid) pooled 2x2 to 16 soft tokens
VISION: dict[str, Any] = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                              image_size=64, patch_size=8, vision_use_head=False, hidden_act="gelu_pytorch_tanh",
                              layer_norm_eps=1e-6)
#: the tiny tokenizer's image tokens (tokenizer.py SPECIAL_TOKENS boi, eoi, image)
IMAGE_TOKENS: dict[str, Any] = dict(boi_token_index=SPECIAL_TOKENS["boi"][1], eoi_token_index=SPECIAL_TOKENS["eoi"][1],
                    image_token_index=SPECIAL_TOKENS["image"][1])


def random_config(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    heads = rng.choice([2, 4])
    n = rng.randint(2, 5)
    return {**BASE, **dict(
        num_hidden_layers=n, layer_types=[rng.choice([_S, _F]) for _ in range(n)],
        hidden_size=rng.choice([32, 64]), intermediate_size=rng.choice([40, 64]), num_attention_heads=heads,
        num_key_value_heads=rng.choice([d for d in (1, 2) if heads % d == 0]), head_dim=rng.choice([8, 16]),
        query_pre_attn_scalar=rng.choice([8, 16, 32]), sliding_window=rng.randint(1, 9),
        tie_word_embeddings=rng.random() < 0.5)}


def build_gemma3_checkpoint(out_dir: Path | str, config_kwargs: dict[str, Any], *, seed: int = 0,
                            dtype: torch.dtype = torch.bfloat16, vision: dict[str, Any] | None = None,
                            mm_tokens_per_image: int = 16) -> Path:
    """``vision``: a SigLIP config, for a multimodal ``gemma3`` checkpoint; None: ``gemma3_text``."""
    from transformers import Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, Gemma3TextConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if vision is None:
        model = Gemma3ForCausalLM(Gemma3TextConfig(**config_kwargs)).eval()
    else:
        text = {k: v for k, v in config_kwargs.items() if k != "tie_word_embeddings"}
        model = Gemma3ForConditionalGeneration(Gemma3Config(
            text_config=text, vision_config=vision, mm_tokens_per_image=mm_tokens_per_image,
            tie_word_embeddings=config_kwargs.get("tie_word_embeddings", True), **IMAGE_TOKENS)).eval()
    generator = randomize_gemma(model, seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # biases near 0 (near 1 they swamp the residual)
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    model.to(dtype).save_pretrained(out, safe_serialization=True)
    build_tiny_gemma_tokenizer(out, vocab_size=config_kwargs["vocab_size"])
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    write_generation_config(out)
    return out


def build_tiny_gemma3(out_dir: Path | str, variant: str = "1b", *, seed: int = 0,
                      dtype: torch.dtype = torch.bfloat16, vision: bool = False) -> Path:
    """``vision``: the multimodal ``gemma3`` layout with the tiny SigLIP tower ``VISION``."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown tiny Gemma3 variant {variant!r}; choose from {sorted(VARIANTS)}")
    return build_gemma3_checkpoint(out_dir, {**BASE, **VARIANTS[variant]}, seed=seed, dtype=dtype,
                                   vision=VISION if vision else None)
