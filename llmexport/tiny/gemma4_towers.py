"""Tiny random Gemma4 checkpoints with vision and/or audio towers (tests, demos).

Structure follows the real checkpoints at toy sizes: the vision tower patchifies 16x16 and pools
3x3 as MNN's runtime requires; the audio tower's first subsampling conv has 128 output channels,
which HF's layout needs (``input_proj_linear`` takes ``channels[0] // 4 * channels[1]`` inputs,
i.e. 128 mel bins / 4 only when channels[0] == 128). Clipped linears get finite, fairly tight
bounds (HF initialises them to +-inf) so that the clamps of ``Gemma4ClippableLinear`` act.
The per-layer-embedding rows of the media tokens are poisoned: the multimodal PLE rule (media
slots look up the pad row) is then checked by every media prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmexport.tiny.gemma4 import SHAPES, build_gemma4_checkpoint, text_config_dict
from llmexport.tiny.tokenizer import SPECIAL_TOKENS

_S, _F = "sliding_attention", "full_attention"
POISON_SCALE = 50.0  # media-token PLE rows; real rows are N(0, 0.05^2)

VISION_SMALL: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    head_dim=16, position_embedding_size=256, use_clipped_linears=True)
VISION_STANDARDIZED: dict[str, Any] = dict(
    hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
    head_dim=16, position_embedding_size=256, standardize=True)
AUDIO_SMALL: dict[str, Any] = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=2, subsampling_conv_channels=[128, 8],
    conv_kernel_size=5, attention_chunk_size=4, attention_context_left=5, attention_context_right=0,
    output_proj_dims=48, use_clipped_linears=True)


@dataclass(frozen=True)
class TinyMultimodal:
    name: str
    text: dict[str, Any]
    vision: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    notes: str = ""
    clip: dict[str, float] = field(default_factory=lambda: {"input": 2.0, "output": 0.3})


def _text(**overrides: Any) -> dict[str, Any]:
    config = text_config_dict(SHAPES["e2b"])
    config.update(overrides)
    return config


MULTIMODAL: dict[str, TinyMultimodal] = {
    # Text hidden 1536: the only size MNN's hard-coded 1/39.25 image scale was written for.
    "vision-1536": TinyMultimodal(
        "vision-1536", _text(hidden_size=1536, intermediate_size=64, num_hidden_layers=4,
                             layer_types=[_S, _F, _S, _F], num_kv_shared_layers=1, use_double_wide_mlp=False),
        vision=VISION_STANDARDIZED, notes="standardized pooler output, no clipping"),
    # Text hidden 64: the runtime's image scale is off by 39.25 / 8; clipped linears, grouped KV heads.
    "vision-64": TinyMultimodal("vision-64", _text(), vision=VISION_SMALL, notes="clipped linears, kv_heads 1"),
    "audio-64": TinyMultimodal("audio-64", _text(), audio=AUDIO_SMALL, notes="clipped linears"),
    # Both towers, as E2B/E4B checkpoints have them.
    "vision-audio-64": TinyMultimodal("vision-audio-64", _text(), vision=VISION_SMALL, audio=AUDIO_SMALL,
                                      notes="both towers in one runtime"),
}


def build_tiny_multimodal(out_dir: Path | str, name: str, *, seed: int = 0,
                          text_overrides: dict[str, Any] | None = None) -> Path:
    """Write the tiny multimodal checkpoint ``name`` (see ``MULTIMODAL``) to ``out_dir``."""
    if name not in MULTIMODAL:
        raise ValueError(f"unknown tiny multimodal checkpoint {name!r}; choose from {sorted(MULTIMODAL)}")
    spec = MULTIMODAL[name]
    text = dict(spec.text, **(text_overrides or {}))
    out = build_gemma4_checkpoint(out_dir, text, seed=seed, vision_config=spec.vision, audio_config=spec.audio)
    _rewrite_tensors(out, spec.clip, seed)
    return out


def _rewrite_tensors(folder: Path, clip: dict[str, float], seed: int) -> None:
    """Finite clip bounds (HF initialises +-inf), varied per linear; and media-token PLE rows
    poisoned with large values: HF never reads them for media slots (the lookup uses the pad id),
    so any export or runtime that does is visibly wrong."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    generator = torch.Generator().manual_seed(seed + 7)
    for name, value in tensors.items():
        kind = name.rsplit(".", 1)[-1]
        if kind in ("input_min", "input_max", "output_min", "output_max") and value.dim() == 0:
            base = clip["input" if kind.startswith("input") else "output"]
            bound = base * float(0.8 + 0.4 * torch.rand((), generator=generator))
            tensors[name] = torch.tensor(-bound if kind.endswith("min") else bound, dtype=value.dtype)
    ple = "model.language_model.embed_tokens_per_layer.weight"
    if ple in tensors:
        for token in (SPECIAL_TOKENS[k][1] for k in ("image", "audio", "video")):
            row = torch.randn(tensors[ple].shape[1], generator=generator) * POISON_SCALE
            tensors[ple][token] = row.to(tensors[ple].dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})
