"""Write a random-weight checkpoint with a released model's shape (not Gemma4: bench/make_checkpoint.py).

    python bench/shaped_checkpoint.py OUT --shape qwen3.5-2b|qwen3-like-qwen3.5-2b|lfm2-1.2b|qwen3-like-lfm2-1.2b|
                                                  llama-3.2-1b|qwen3-0.6b
                                      [--layers N] [--shard-gb 2] [--dry]

Streamed tensor by tensor (bench/random_weights.py): names and shapes from the HF model built on the
meta device, bf16 like the released files, nothing held in memory. The text decoder only, in the
layout ``AutoModelForCausalLM`` saves (a released Qwen3.5 checkpoint is multimodal; its tower is
left out here and by the export).

Shapes (the released configs were not readable offline; the values are the model cards' and the
public ports' quoted configs, checked against the parameter counts):
- ``qwen3.5-2b``: Qwen/Qwen3.5-2B's text model: 24 layers in six groups of three Gated DeltaNet
  layers and one gated full-attention layer, hidden 2048, FFN 6144; linear attention 16 key and
  16 value heads of 128, conv kernel 4; full attention 8 query and 2 KV heads of 256, partial
  rotary 0.25 with interleaved M-RoPE sections [11, 11, 10], theta 1e7; tied embeddings;
  vocabulary 248320 (1.88B parameters). Tokenizer: Qwen3.5's real vocabulary
  (``ggml-vocab-qwen35``, rebuilt by tests/real_vocab_tokenizers.py) with its real chat template.
- ``lfm2-1.2b``: LiquidAI/LFM2-1.2B: 16 layers, attention at 2, 5, 8, 10, 12, 14 (32 query and 8
  KV heads of 64), short convolutions (L_cache 3) elsewhere, hidden 2048, FFN 12288 auto-adjusted
  to 8192, vocabulary 65536, tied embeddings (1.17B parameters). Tokenizer: a small trained
  byte-level BPE with ChatML markers (the real LFM2 vocabulary is not on any registry); the
  embedding keeps all 65536 rows.
- ``llama-3.2-1b``: meta-llama/Llama-3.2-1B: 16 layers, hidden 2048, 32 query and 8 KV heads of
  64, FFN 8192, rope llama3 scaling (factor 32, low/high frequency factors 1 and 4, original 8192
  positions), theta 5e5; tied embeddings; vocabulary 128256 (1.24B parameters). Tokenizer: Llama-3's
  real vocabulary (``ggml-vocab-llama-bpe``) with Llama-3.2's real chat template.
- ``qwen3-0.6b``: Qwen/Qwen3-0.6B: 28 layers, hidden 1024, 16 query and 8 KV heads of 128, FFN
  3072, theta 1e6; tied embeddings; vocabulary 151936 (0.60B parameters). Tokenizer: Qwen2's real
  vocabulary (``ggml-vocab-qwen2``, the one Qwen3 keeps) with Qwen3's real chat template.
- ``qwen3-like-*``: a Qwen3 dense model of the same width, depth, FFN, vocabulary and tokenizer,
  every layer full attention (Qwen3.5's 8/2 heads of 256; LFM2's 32/8 heads of 64): what the
  hybrid layers are measured against.

Values: linears, tables and conv kernels N(0, 0.02); 1-D tensors (norm gammas, A_log, dt_bias)
uniform in [0.6, 1.4], except Qwen3.5's norms, stored as offsets from 1 ((1 + w) RMSNorm),
uniform in [-0.4, 0.4], so both families scale by 0.6-1.4 (the gated norm of its linear
attention is a plain gamma).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from random_weights import meta_specs, nbytes, normal_values, uniform_values, write_shards  # noqa: E402

GIB = 2**30
QWEN35_LAYERS = (["linear_attention"] * 3 + ["full_attention"]) * 6
LFM2_ATTENTION = (2, 5, 8, 10, 12, 14)


@dataclass(frozen=True)
class Shape:
    config_class: str
    model_class: str
    config: dict[str, Any]
    tokenizer: str  # a REAL_VOCABS key: the real vocabulary; "chatml": a small trained one
    one_plus_norms: bool = False  # gammas stored as offsets from 1
    notes: dict[str, Any] = field(default_factory=dict)


_QWEN35 = dict(vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
               num_attention_heads=8, num_key_value_heads=2, head_dim=256, rms_norm_eps=1e-6,
               tie_word_embeddings=True, max_position_embeddings=262144)
_LFM2 = dict(vocab_size=65536, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
             tie_word_embeddings=True, max_position_embeddings=128000)
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
SHAPES: dict[str, Shape] = {
    "qwen3.5-2b": Shape("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        _QWEN35, layer_types=QWEN35_LAYERS, linear_conv_kernel_dim=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=16,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True}), "qwen35", one_plus_norms=True),
    "qwen3-like-qwen3.5-2b": Shape("Qwen3Config", "Qwen3ForCausalLM", dict(
        _QWEN35, rope_parameters={"rope_type": "default", "rope_theta": 1e7}), "qwen35"),
    "lfm2-1.2b": Shape("Lfm2Config", "Lfm2ForCausalLM", dict(
        _LFM2, intermediate_size=12288, block_auto_adjust_ff_dim=True, block_multiple_of=256,
        block_ffn_dim_multiplier=1.0, conv_L_cache=3, norm_eps=1e-5,
        layer_types=["full_attention" if i in LFM2_ATTENTION else "conv" for i in range(16)],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}), "chatml"),
    "qwen3-like-lfm2-1.2b": Shape("Qwen3Config", "Qwen3ForCausalLM", dict(
        _LFM2, intermediate_size=8192, head_dim=64, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}), "chatml"),
    "llama-3.2-1b": Shape("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, tie_word_embeddings=True,
        max_position_embeddings=131072, rope_parameters=_LLAMA3_ROPE), "llama-bpe"),
    "qwen3-0.6b": Shape("Qwen3Config", "Qwen3ForCausalLM", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, tie_word_embeddings=True,
        max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1e6}), "qwen2"),
}
#: real vocabulary (tests/real_vocab_tokenizers.py) -> (the sdist's chat template, bos, end-of-turn, pad token);
#: Llama-3.2 has no pad token
REAL_VOCABS: dict[str, tuple[str, str | None, str, str | None]] = {
    "qwen35": ("Qwen3.5-4B", None, "<|im_end|>", "<|endoftext|>"),
    "qwen2": ("Qwen-Qwen3-0.6B", None, "<|im_end|>", "<|endoftext|>"),
    "llama-bpe": ("meta-llama-Llama-3.2-3B-Instruct", "<|begin_of_text|>", "<|eot_id|>", None),
}


def _tokenizer(out: Path, kind: str, vocab_size: int) -> dict[str, Any]:
    """Write the tokenizer files; returns the token ids config.json carries."""
    from tokenizers import Tokenizer

    from llmexport.tiny.byte_level_tokenizer import write_checkpoint_tokenizer, write_generation_config

    if kind == "chatml":
        ids = write_checkpoint_tokenizer(out, "qwen", min(vocab_size, 4096))
    else:
        from real_vocab_tokenizers import rebuild

        from real_vocab import sdist_template

        template, bos, eos, pad = REAL_VOCABS[kind]
        rebuild(kind, out)
        (out / "chat_template.jinja").write_text(sdist_template(template), encoding="utf-8")
        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
        ids = {"bos_token_id": bos and tok.token_to_id(bos), "eos_token_id": [tok.token_to_id(eos)],
               "pad_token_id": pad and tok.token_to_id(pad)}
        missing = (None in ids["eos_token_id"] or (pad and ids["pad_token_id"] is None)
                   or (bos and ids["bos_token_id"] is None))
        if missing:
            raise SystemExit(f"{kind}: a marker token is missing from the vocabulary: {ids}")
    if Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size() > vocab_size:
        raise SystemExit(f"{kind}: the tokenizer has more ids than the vocabulary ({vocab_size})")
    write_generation_config(out, ids)
    return ids


def write_checkpoint(out: Path, name: str, layers: int | None = None, shard_bytes: int = 2 * GIB,
                     dry: bool = False) -> Path:
    import transformers

    shape = SHAPES[name]
    cfg = dict(shape.config)
    if layers:
        cfg["num_hidden_layers"] = layers
        for key in ("layer_types",):
            if key in cfg:
                cfg[key] = cfg[key][:layers]
    config_class = getattr(transformers, shape.config_class)
    model_class = getattr(transformers, shape.model_class)
    tied = cfg.get("tie_word_embeddings", False)
    specs = meta_specs(model_class, config_class(**cfg), lambda n: tied and n == "lm_head.weight")
    total = sum(nbytes(s) for _, s in specs)
    print(f"{name}: {len(specs)} tensors, {total / 2 / 1e9:.2f}B parameters, {total / GIB:.2f} GiB bf16", flush=True)
    if dry:
        return out
    out.mkdir(parents=True, exist_ok=True)
    ids = _tokenizer(out, shape.tokenizer, cfg["vocab_size"])
    config = config_class(**cfg, **ids)

    def generate(tensor: str, dims: tuple[int, ...], file, generator) -> None:
        if len(dims) > 1:
            normal_values(dims, file, generator)
        elif shape.one_plus_norms and tensor.endswith("norm.weight") and ".linear_attn.norm." not in tensor:
            uniform_values(dims, file, generator, -0.4, 0.4)
        else:
            uniform_values(dims, file, generator, 0.6, 1.4)

    write_shards(out, specs, shard_bytes, generate)
    data = config.to_dict()
    data.update(architectures=[shape.model_class], dtype="bfloat16")
    (out / "config.json").write_text(json.dumps(data, indent=2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the released depth)")
    parser.add_argument("--shard-gb", type=float, default=2.0)
    parser.add_argument("--dry", action="store_true", help="print the tensor count and size, write nothing")
    args = parser.parse_args()
    write_checkpoint(args.out, args.shape, args.layers, int(args.shard_gb * GIB), args.dry)


if __name__ == "__main__":
    main()
