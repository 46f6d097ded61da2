"""Tiny random Phi-3 checkpoints (``phi3``, ``Phi3ForCausalLM``).

Phi-4-mini's structure at toy sizes: partial rotary (0.75), longrope with short factors not all 1
and an original context of 256 positions (the exported context), tied embeddings; Phi-3.5-mini's:
full rotary, untied head; Phi-3-mini-4k's: default RoPE, a sliding window on every layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from llmexport.tiny.tokenizer import build_tiny_sentencepiece_tokenizer
from llmexport.tiny.weights import randomize

TINY_VOCAB = 512 + 11  # the Phi-3 chat tokens after the model vocabulary
# Phi-3.5-mini's chat template
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)


def _longrope(pairs: int) -> dict[str, Any]:
    return {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
            "short_factor": [1.0 + 0.25 * i for i in range(pairs)], "long_factor": [2.0 + i for i in range(pairs)],
            "original_max_position_embeddings": 256}


BASE: dict[str, Any] = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                            original_max_position_embeddings=256, rms_norm_eps=1e-5, hidden_act="silu",
                            tie_word_embeddings=False, rope_parameters=_longrope(8), pad_token_id=0,
                            bos_token_id=1, eos_token_id=TINY_VOCAB - 11)

VARIANTS: dict[str, dict[str, Any]] = {
    "phi3.5": {},
    # Phi-3-mini-4k's: default RoPE and a sliding window on every layer (2047 there), shorter than the prompts
    "phi3-mini-4k": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, sliding_window=12,
                         max_position_embeddings=256),
    "phi4-mini": dict(tie_word_embeddings=True,
                      rope_parameters={**_longrope(6), "partial_rotary_factor": 0.75}),
}


def build_tiny_phi3(out_dir: Path | str, variant: str = "phi4-mini", *, seed: int = 0,
                    dtype: torch.dtype = torch.bfloat16) -> Path:
    from transformers import Phi3Config, Phi3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = Phi3ForCausalLM(Phi3Config(**{**BASE, **VARIANTS[variant]})).eval()
    randomize(model, torch.Generator().manual_seed(seed + 1))
    model.to(dtype).save_pretrained(out, safe_serialization=True)
    build_tiny_sentencepiece_tokenizer(out, "phi3", vocab_size=512)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    return out
