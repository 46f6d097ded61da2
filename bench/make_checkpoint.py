"""Write a random-weight Gemma4 checkpoint with real E2B, E4B, 31B or 26B-A4B dimensions, tensor by tensor.

    python bench/make_checkpoint.py OUT [--model e2b|e4b|31b|26b-a4b] [--layers N] [--shard-gb 2]
                                        [--vocab 262144] [--dry] [--qk-gamma 0.25]

The model is never held in memory: tensor names and shapes come from the HF model built on the
meta device, and each tensor is generated in row chunks straight into sharded safetensors files
(with an index), bf16 like the real checkpoints. ``--layers`` scales the depth (the KV-shared
tail keeps its share of the layers; the sliding/full pattern keeps its period and the last layer
is full, as transformers forces) to measure how memory grows with depth, or to cut the large
shapes (31B is about 58 GiB bf16 in full) to what a disk holds. ``--dry`` prints the tensor count
and bytes (total, embedding table, one sliding and one full layer) without writing anything.
Only the text decoder is written (no vision/audio tower), so the released checkpoints are larger
by their towers.

Values: linears and tables N(0, 0.02); gammas and layer scalars uniform in [0.6, 1.4], except the
query and key norms' gammas, which are scaled by ``--qk-gamma`` (0.25 by default). Gemma4 scales
attention by 1.0 and leans on those norms to keep the softmax soft: with gammas near 1 the scores
of a 256-wide head have a standard deviation near 16, every softmax is an argmax of noise and a
full-depth model is chaotic (a 42-layer E4B-shaped model, width 512: a 1e-6 relative perturbation
of its weights moves the logits by 1.3 and flips 65% of the top-1 tokens; at 0.25, 4e-5 and none),
so no two correct fp32 implementations agree on it and no verification can pass. ``--qk-gamma 1``
writes the earlier, chaotic checkpoints.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmexport.tiny.tokenizer import SPECIAL_TOKENS, build_tiny_gemma_tokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_weights import meta_specs, nbytes, normal_values, uniform_values, write_shards  # noqa: E402

S, F = "sliding_attention", "full_attention"
# Dimensions of the released checkpoints' text configs. `full_every`: one full layer per that
# many layers (the rest sliding); `sliding_window`, `max_position_embeddings` and
# `tie_word_embeddings` are the released values too, rope_parameters are shared by all four
# (sliding: default, theta 1e4; full: proportional, partial_rotary_factor 0.25, theta 1e6) and
# final_logit_softcapping is 30.0 for all four.
MODELS = {
    # E2B/E4B: as this script always had them (four sliding, then one full). Note: the released
    # E4B text_config is five sliding then one full (42 = 7 x 6; e.g. the E4B fixtures quoted in
    # public Gemma4 ports: layer_types ([S] * 5 + [F]) * 7);
    # kept at 4:1 here so earlier E4B measurements stay comparable.
    "e2b": dict(hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8,
                num_key_value_heads=1, head_dim=256, global_head_dim=512, hidden_size_per_layer_input=256,
                num_kv_shared_layers=20, use_double_wide_mlp=True),
    "e4b": dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=42, num_attention_heads=8,
                num_key_value_heads=2, head_dim=256, global_head_dim=512, hidden_size_per_layer_input=256,
                num_kv_shared_layers=18, use_double_wide_mlp=False),
    # google/gemma-4-31B-it text_config. No released config.json is in the local search index;
    # the values agree across independent public copies of it: HF config.json of 31B-derived
    # repos (OpenMOSE/Gemma4-Text, lthn/lemrd: hidden 5376, intermediate 21504, k_eq_v, PLE 0,
    # softcap 30, global_head_dim 512, 5:1 layer_types), the model card of
    # mlboydaisuke/Gemma-4-31B-CoreAI ("60 layers, hidden 5376, 32 heads, vocab 262144, softcap
    # 30, tied embeddings, 5:1 sliding:full, sliding 256 / global_head_dim 512,
    # num_global_key_value_heads 4 with attention_k_eq_v"), and test fixtures in public ports
    # that state they copy the Hub config (num_key_value_heads 16, num_global_key_value_heads 4,
    # sliding_window 1024, max_position_embeddings 262144, tie_word_embeddings true,
    # num_kv_shared_layers 0). Dense: no MoE, no KV sharing, no per-layer embeddings.
    "31b": dict(hidden_size=5376, intermediate_size=21504, num_hidden_layers=60, num_attention_heads=32,
                num_key_value_heads=16, num_global_key_value_heads=4, attention_k_eq_v=True,
                head_dim=256, global_head_dim=512, hidden_size_per_layer_input=0,
                num_kv_shared_layers=0, use_double_wide_mlp=False,
                full_every=6, sliding_window=1024, max_position_embeddings=262144, tie_word_embeddings=True),
    # google/gemma-4-26B-A4B-it text_config, from public copies of its config.json (e.g.
    # LetheanNetwork/lemmy-pt config.json, and Gemma4 26B fixtures in public MLX/Rust/Go ports):
    # hidden 2816, dense MLP intermediate 2112 in parallel with 128 experts top-8 of
    # moe_intermediate_size 704, 30 layers 5:1, 16 heads, 8 KV heads (2 on full layers, K=V),
    # head_dim 256 / global 512, sliding_window 1024, max_position_embeddings 262144, tied
    # embeddings, no PLE; transformers' own EP plan comment also names
    # num_global_key_value_heads=2 for google/gemma-4-26B-A4B-it (configuration_gemma4.py).
    "26b-a4b": dict(hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16,
                    num_key_value_heads=8, num_global_key_value_heads=2, attention_k_eq_v=True,
                    head_dim=256, global_head_dim=512, hidden_size_per_layer_input=0,
                    num_kv_shared_layers=0, use_double_wide_mlp=False,
                    enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
                    full_every=6, sliding_window=1024, max_position_embeddings=262144, tie_word_embeddings=True),
}
# Defaults of the keys above that E2B/E4B leave out (their released values).
_LAYOUT = dict(full_every=5, sliding_window=512, max_position_embeddings=131072, tie_word_embeddings=True)


def text_config(model: str, layers: int | None, vocab: int = 262144) -> dict:
    cfg = {**_LAYOUT, **MODELS[model]}
    every = cfg.pop("full_every")
    n = layers or cfg["num_hidden_layers"]
    shared = round(cfg["num_kv_shared_layers"] * n / cfg["num_hidden_layers"])
    cfg.update(num_hidden_layers=n, num_kv_shared_layers=min(shared, n - 5) if n > 5 else 0,
               layer_types=[F if (i + 1) % every == 0 or i == n - 1 else S for i in range(n)],
               vocab_size=vocab, vocab_size_per_layer_input=vocab, final_logit_softcapping=30.0,
               pad_token_id=0, bos_token_id=2, eos_token_id=1,
               rope_parameters={S: {"rope_type": "default", "rope_theta": 10000.0},
                                F: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                    "rope_theta": 1000000.0}})
    return cfg


def _tensor_specs(cfg: dict) -> tuple[list[tuple[str, tuple[int, ...]]], object]:
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig

    ids = {name: SPECIAL_TOKENS[name][1] for name in SPECIAL_TOKENS}
    tied = cfg.get("tie_word_embeddings", True)
    config = Gemma4Config(text_config=Gemma4TextConfig(**cfg).to_dict(), vision_config=None, audio_config=None,
                          tie_word_embeddings=tied,
                          boi_token_id=ids["boi"], eoi_token_id=ids["eoi"], image_token_id=ids["image"],
                          boa_token_id=ids["boa"], eoa_token_index=ids["eoa"], audio_token_id=ids["audio"],
                          video_token_id=ids["video"])
    return meta_specs(Gemma4ForConditionalGeneration, config, lambda name: tied and name == "lm_head.weight"), config


def size_report(cfg: dict, specs: list[tuple[str, tuple[int, ...]]]) -> str:
    """Tensor count and bytes: total, embedding table(s), one layer of each kind present."""
    per_layer: dict[int, int] = {}
    other = 0
    for name, shape in specs:
        match = re.search(r"\.layers\.(\d+)\.", name)
        if match:
            per_layer[int(match.group(1))] = per_layer.get(int(match.group(1)), 0) + nbytes(shape)
        else:
            other += nbytes(shape)
    total = other + sum(per_layer.values())
    kinds = cfg["layer_types"]
    head = "" if cfg.get("tie_word_embeddings", True) else ", lm_head"
    lines = [f"{len(specs)} tensors, {total} bytes ({total / 2**30:.2f} GiB) bf16; layers: "
             f"{kinds.count(S)} sliding + {kinds.count(F)} full = {len(kinds)}",
             f"  outside the layers (embeddings, final norm{head}): {other} bytes"]
    for kind in (S, F):
        layer = next((i for i, t in enumerate(kinds) if t == kind and i in per_layer), None)
        if layer is not None:  # KV-shared layers of E2B/E4B are smaller; this is the first one
            lines.append(f"  one {kind.split('_')[0]} layer (layer {layer}): {per_layer[layer]} bytes")
    return "\n".join(lines)


_QK_NORM = re.compile(r"\.self_attn\.[qk]_norm\.weight$")


def _generate(qk_gamma: float):
    def generate(name: str, shape: tuple[int, ...], out, generator: torch.Generator) -> None:
        if len(shape) > 1:
            normal_values(shape, out, generator)
        elif _QK_NORM.search(name):  # gammas and scalars near 1; the query/key norms' scaled
            uniform_values(shape, out, generator, 0.6 * qk_gamma, 1.4 * qk_gamma)
        else:
            uniform_values(shape, out, generator, 0.6, 1.4)
    return generate


def write_checkpoint(out: Path, model: str, layers: int | None, shard_bytes: int, vocab: int = 262144,
                     dry: bool = False, qk_gamma: float = 0.25) -> Path:
    cfg = text_config(model, layers, vocab)
    specs, config = _tensor_specs(cfg)
    print(f"{model}: " + size_report(cfg, specs), flush=True)
    if dry:
        return out
    write_shards(out, specs, shard_bytes, _generate(qk_gamma))
    data = config.to_dict()
    data["architectures"] = ["Gemma4ForConditionalGeneration"]
    data["dtype"] = "bfloat16"
    # The released configs name the full layers' head size and K=V head count directly; transformers
    # writes them as per_layer_config (which wins on reload) and leaves these null.
    for key in ("global_head_dim", "num_global_key_value_heads"):
        if data["text_config"].get(key) is None and cfg.get(key) is not None:
            data["text_config"][key] = cfg[key]
    (out / "config.json").write_text(json.dumps(data, indent=2))
    build_tiny_gemma_tokenizer(out, vocab_size=vocab)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", choices=sorted(MODELS), default="e2b")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (default: the real depth); the sliding/full pattern keeps its period")
    parser.add_argument("--shard-gb", type=float, default=2.0)
    parser.add_argument("--vocab", type=int, default=262144,
                        help="vocabulary (the real one by default; smaller keeps other exporters' memory in reach)")
    parser.add_argument("--dry", action="store_true", help="print tensor count and bytes, write nothing")
    parser.add_argument("--qk-gamma", type=float, default=0.25,
                        help="scale of the query/key norm gammas (1: the chaotic checkpoints of earlier runs)")
    args = parser.parse_args()
    write_checkpoint(args.out, args.model, args.layers, int(args.shard_gb * 2**30), args.vocab, args.dry,
                     args.qk_gamma)
    if not args.dry:
        total = sum(p.stat().st_size for p in args.out.glob("*.safetensors"))
        print(f"checkpoint: {args.out} ({total} bytes, {total / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
