"""A tiny random Qwen3-VL checkpoint (``qwen3_vl``: Qwen3VLForConditionalGeneration), built with
transformers' own classes: the Qwen3 text model (per-head q/k norms, 16-dim heads whose 8 rotary
pairs split into M-RoPE sections [4, 2, 2], interleaved as released) under
``model.language_model.``, and Qwen3.5's tiny tower (llmexport.tiny.qwen3_5) with three blocks
and DeepStack mergers after the first two. Qwen's ByteLevel BPE tokenizer with the ChatML
template, bf16 weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from llmexport.tiny.byte_level_tokenizer import write_checkpoint_tokenizer, write_generation_config
from llmexport.tiny.qwen3_5 import TINY_VOCAB, VISION, vision_token_ids
from llmexport.tiny.weights import save_random

TEXT: dict[str, Any] = dict(
    vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6,
    attention_bias=False,
    rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [4, 2, 2],
                     "mrope_interleaved": True})
DEEPSTACK = [0, 1]  # the released towers: [8, 16, 24] of 27 blocks (24 of the 2B's)


def build_tiny_qwen3_vl(out_dir: Path | str, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                        text: dict[str, Any] | None = None, tie: bool = False) -> Path:
    """Write the tiny Qwen3-VL (``text``: overrides of the text config; ``tie``: the head tied to
    the embeddings, as the released 2B and 4B) to ``out_dir``."""
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text_config = {**TEXT, **(text or {})}
    token_ids = write_checkpoint_tokenizer(out, "qwen", text_config["vocab_size"], None)
    ids = vision_token_ids(Tokenizer.from_file(str(out / "tokenizer.json")))
    vision = dict(VISION, depth=3, deepstack_visual_indexes=DEEPSTACK, out_hidden_size=text_config["hidden_size"])
    config_class, text_class = (getattr(transformers, name) for name in ("Qwen3VLConfig", "Qwen3VLTextConfig"))
    config = config_class(text_config=text_class(**text_config, **token_ids, tie_word_embeddings=tie).to_dict(),
                          vision_config=vision, tie_word_embeddings=tie, **ids)
    save_random("Qwen3VLForConditionalGeneration", config, out, seed, dtype)
    write_generation_config(out, token_ids)
    return out
