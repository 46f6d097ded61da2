"""Write a random-weight Gemma4 checkpoint with real E2B or E4B dimensions, tensor by tensor.

    python bench/make_checkpoint.py OUT [--model e2b|e4b] [--layers N] [--shard-gb 2] [--vocab 262144]

The model is never held in memory: tensor names and shapes come from the HF model built on the
meta device, and each tensor is generated in row chunks straight into sharded safetensors files
(with an index), bf16 like the real checkpoints. ``--layers`` scales the depth (the KV-shared
tail keeps its share of the layers) to measure how memory grows with depth.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmexport.tiny.tokenizer import SPECIAL_TOKENS, build_tiny_gemma_tokenizer  # noqa: E402

S, F = "sliding_attention", "full_attention"
# Dimensions of the released checkpoints' text configs (four sliding layers, then one full).
MODELS = {
    "e2b": dict(hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8,
                num_key_value_heads=1, head_dim=256, global_head_dim=512, hidden_size_per_layer_input=256,
                num_kv_shared_layers=20, use_double_wide_mlp=True),
    "e4b": dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=42, num_attention_heads=8,
                num_key_value_heads=2, head_dim=256, global_head_dim=512, hidden_size_per_layer_input=256,
                num_kv_shared_layers=18, use_double_wide_mlp=False),
}
_CHUNK = 1 << 24  # values generated at once


def text_config(model: str, layers: int | None, vocab: int = 262144) -> dict:
    cfg = dict(MODELS[model])
    n = layers or cfg["num_hidden_layers"]
    shared = round(cfg["num_kv_shared_layers"] * n / cfg["num_hidden_layers"])
    cfg.update(num_hidden_layers=n, num_kv_shared_layers=min(shared, n - 5) if n > 5 else 0,
               layer_types=[F if (i + 1) % 5 == 0 or i == n - 1 else S for i in range(n)],
               vocab_size=vocab, vocab_size_per_layer_input=vocab, sliding_window=512,
               final_logit_softcapping=30.0, max_position_embeddings=131072, tie_word_embeddings=True,
               pad_token_id=0, bos_token_id=2, eos_token_id=1,
               rope_parameters={S: {"rope_type": "default", "rope_theta": 10000.0},
                                F: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                    "rope_theta": 1000000.0}})
    return cfg


def _tensor_specs(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig

    ids = {name: SPECIAL_TOKENS[name][1] for name in SPECIAL_TOKENS}
    config = Gemma4Config(text_config=Gemma4TextConfig(**cfg).to_dict(), vision_config=None, audio_config=None,
                          boi_token_id=ids["boi"], eoi_token_id=ids["eoi"], image_token_id=ids["image"],
                          boa_token_id=ids["boa"], eoa_token_index=ids["eoa"], audio_token_id=ids["audio"],
                          video_token_id=ids["video"])
    with torch.device("meta"):
        model = Gemma4ForConditionalGeneration(config)
    state = model.state_dict()
    specs = [(name, tuple(t.shape)) for name, t in state.items() if name != "lm_head.weight"]
    return specs, config


def _generate(name: str, shape: tuple[int, ...], out, generator: torch.Generator) -> None:
    numel = 1
    for d in shape:
        numel *= d
    if len(shape) <= 1:  # gammas and scalars near 1
        values = (torch.rand(numel, generator=generator) * 0.8 + 0.6).to(torch.bfloat16)
        out.write(values.view(torch.uint8).numpy().tobytes())
        return
    for start in range(0, numel, _CHUNK):
        count = min(_CHUNK, numel - start)
        values = (torch.randn(count, generator=generator) * 0.02).to(torch.bfloat16)
        out.write(values.view(torch.uint8).numpy().tobytes())


def write_checkpoint(out: Path, model: str, layers: int | None, shard_bytes: int, vocab: int = 262144) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    cfg = text_config(model, layers, vocab)
    specs, config = _tensor_specs(cfg)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in specs:
        nbytes = 2 * max(1, int(torch.tensor(shape).prod().item()) if shape else 1)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    generator = torch.Generator().manual_seed(0)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for name, shape in shard:
            nbytes = 2 * int(torch.tensor(shape).prod().item() if shape else 1)
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = file
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(out / file, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for name, shape in shard:
                _generate(name, shape, f, generator)
        print(f"wrote {file} ({len(shard)} tensors)", flush=True)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    data = config.to_dict()
    data["architectures"] = ["Gemma4ForConditionalGeneration"]
    data["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(data, indent=2))
    build_tiny_gemma_tokenizer(out, vocab_size=vocab)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", choices=sorted(MODELS), default="e2b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--shard-gb", type=float, default=2.0)
    parser.add_argument("--vocab", type=int, default=262144,
                        help="vocabulary (the real one by default; smaller keeps other exporters' memory in reach)")
    args = parser.parse_args()
    write_checkpoint(args.out, args.model, args.layers, int(args.shard_gb * 2**30), args.vocab)
    total = sum(p.stat().st_size for p in args.out.glob("*.safetensors"))
    print(f"checkpoint: {args.out} ({total / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
