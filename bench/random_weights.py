"""Random bf16 weights streamed into sharded safetensors files, never holding a model in memory.

Shared by the shaped-checkpoint writers (bench/make_checkpoint.py for Gemma4,
bench/shaped_checkpoint.py for the other families): tensor names and shapes come from an HF model
built on the meta device; each tensor is generated in chunks straight into its shard.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Callable

import torch

CHUNK = 1 << 24  # values generated at once
Spec = tuple[str, tuple[int, ...]]


def numel(shape: tuple[int, ...]) -> int:
    count = 1
    for d in shape:
        count *= d
    return count


def nbytes(shape: tuple[int, ...]) -> int:
    """bf16 bytes of a tensor (a scalar ``()`` is one value)."""
    return 2 * numel(shape)


def meta_specs(model_class, config, skip: Callable[[str], bool] = lambda name: False) -> list[Spec]:
    """(name, shape) of every tensor of ``model_class(config)`` built on the meta device."""
    with torch.device("meta"):
        model = model_class(config)
    return [(name, tuple(t.shape)) for name, t in model.state_dict().items() if not skip(name)]


def write_bf16(out, values: torch.Tensor) -> None:
    out.write(values.to(torch.bfloat16).view(torch.uint8).numpy().tobytes())


def normal_values(shape: tuple[int, ...], out, generator: torch.Generator, std: float = 0.02) -> None:
    """N(0, std) values, generated ``CHUNK`` at a time."""
    total = numel(shape)
    for start in range(0, total, CHUNK):
        write_bf16(out, torch.randn(min(CHUNK, total - start), generator=generator) * std)


def uniform_values(shape: tuple[int, ...], out, generator: torch.Generator, low: float, high: float) -> None:
    write_bf16(out, torch.rand(numel(shape), generator=generator) * (high - low) + low)


def write_shards(out: Path, specs: list[Spec], shard_bytes: int,
                 generate: Callable[[str, tuple[int, ...], object, torch.Generator], None], seed: int = 0) -> None:
    """Write ``specs`` as bf16 safetensors shards of at most ``shard_bytes`` (a tensor larger than
    that gets a shard of its own) with ``model.safetensors.index.json``; ``generate(name, shape,
    file, generator)`` writes each tensor's values."""
    out.mkdir(parents=True, exist_ok=True)
    shards: list[list[Spec]] = [[]]
    size = 0
    for name, shape in specs:
        if shards[-1] and size + nbytes(shape) > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes(shape)
    generator = torch.Generator().manual_seed(seed)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for name, shape in shard:
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes(shape)]}
            offset += nbytes(shape)
            weight_map[name] = file
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(out / file, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for name, shape in shard:
                generate(name, shape, f, generator)
        print(f"wrote {file} ({len(shard)} tensors)", flush=True)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
