"""A tiny random Qwen3-VL checkpoint (``qwen3_vl``: Qwen3VLForConditionalGeneration), built with
transformers' own classes: the Qwen3 text model (per-head q/k norms, 16-dim heads whose 8 rotary
pairs split into M-RoPE sections [4, 2, 2], interleaved as released) under
``model.language_model.``, and Qwen3.5's tiny tower (llmexport.tiny.qwen3_5) with three blocks
and DeepStack mergers after the first two. Qwen's ByteLevel BPE tokenizer with the ChatML
template, bf16 weights. With ``moe`` it is Qwen3-VL-MoE (``qwen3_vl_moe``:
Qwen3VLMoeForConditionalGeneration): six routed experts (top 2) on layers 0 and 2, layer 1 dense
(``mlp_only_layers``), the expert stacks stored transposed as the released checkpoints do
(``transpose_stacks``; transformers' save_pretrained writes its in-memory layout).
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
#: Qwen3-VL-MoE's text additions: a 24-wide expert makes every stack's two layouts differ in shape
MOE: dict[str, Any] = dict(moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2, decoder_sparse_step=1,
                           mlp_only_layers=[1])
DEEPSTACK = [0, 1]  # the released towers: [8, 16, 24] of 27 blocks (24 of the 2B's)


def transpose_stacks(checkpoint: Path) -> None:
    """Rewrite ``checkpoint``'s single ``model.safetensors`` with its stacked experts
    (``mlp.experts.gate_up_proj`` / ``down_proj``) transposed, [E, in, out], as released."""
    from safetensors.torch import load_file, save_file

    path = checkpoint / "model.safetensors"
    tensors = load_file(str(path))
    for name in [n for n in tensors if n.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]:
        tensors[name] = tensors[name].transpose(1, 2)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path), metadata={"format": "pt"})


def build_tiny_qwen3_vl(out_dir: Path | str, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                        text: dict[str, Any] | None = None, tie: bool = False, moe: bool = False,
                        released: bool = True) -> Path:
    """Write the tiny Qwen3-VL (``text``: overrides of the text config; ``tie``: the head tied to
    the embeddings, as the released 2B and 4B; ``moe``: Qwen3-VL-MoE, its expert stacks
    transposed when ``released``) to ``out_dir``."""
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text_config = {**TEXT, **(MOE if moe else {}), **(text or {})}
    token_ids = write_checkpoint_tokenizer(out, "qwen", text_config["vocab_size"], None)
    ids = vision_token_ids(Tokenizer.from_file(str(out / "tokenizer.json")))
    vision = dict(VISION, depth=3, deepstack_visual_indexes=DEEPSTACK, out_hidden_size=text_config["hidden_size"])
    kind = "Qwen3VLMoe" if moe else "Qwen3VL"
    config_class, text_class = (getattr(transformers, kind + name) for name in ("Config", "TextConfig"))
    config = config_class(text_config=text_class(**text_config, **token_ids, tie_word_embeddings=tie).to_dict(),
                          vision_config=vision, tie_word_embeddings=tie, **ids)
    save_random(kind + "ForConditionalGeneration", config, out, seed, dtype)
    if moe and released:
        transpose_stacks(out)
    write_generation_config(out, token_ids)
    return out
