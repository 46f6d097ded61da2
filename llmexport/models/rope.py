"""Rotary position embeddings: the inverse-frequency tables and their use in the graph.

Every family here uses HF's rotate-half layout (dims i and i + head_dim/2 form a pair). The
tables mirror transformers' ``modeling_rope_utils``: "default", Gemma4's "proportional" (first
``rotated_pairs`` pairs live, the rest zero) and Llama-3's "llama3" frequency scaling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's rescaling of the frequencies (``_compute_llama3_parameters``): wavelengths
    beyond ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``,
    those below ``original / high_freq_factor`` kept, the band between interpolated."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        old = self.original_max_position_embeddings
        low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)


@dataclass(frozen=True)
class RopeSpec:
    """One RoPE table: rotate-half layout over ``head_dim`` with ``rotated_pairs`` live pairs.

    HF's "proportional" RoPE (full layers) keeps the frequency of pair i (dims i and
    i + head_dim/2) for i < rotated_pairs and zeroes the rest (transformers
    modeling_rope_utils._compute_proportional_rope_parameters); "default" rotates every pair.
    """

    theta: float
    head_dim: int
    rotated_pairs: int
    factor: float = 1.0
    llama3: Llama3Scaling | None = None

    def inv_freq(self) -> torch.Tensor:
        live = 1.0 / (self.theta ** (torch.arange(0, 2 * self.rotated_pairs, 2, dtype=torch.int64).float()
                                     / self.head_dim))
        if self.llama3 is not None:
            live = self.llama3.apply(live)
        dead = torch.zeros(self.head_dim // 2 - self.rotated_pairs)
        return torch.cat([live, dead]) / self.factor


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [1, seq, 1, head_dim] for int positions [1, seq] (both halves of a pair share
    a frequency)."""
    freqs = position_ids.float().view(1, -1, 1) * inv_freq.view(1, 1, -1)
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(2)
    return emb.cos(), emb.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Apply rotate-half RoPE to [1, seq, heads, head_dim]. ``head_dim`` is passed as a Python
    int: ``x.shape[-1]`` would trace as a dozen shape ops (Shape, Gather, Div, ...) per call."""
    half = head_dim // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def rotate_prefix(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
                  head_dim: int) -> torch.Tensor:
    """Partial rotary (Phi-3, Qwen3.5; transformers' apply_rotary_pos_emb with a narrower
    cos/sin): ``rotate`` on the first ``rotary_dim`` dims of [1, seq, heads, head_dim] (cos/sin
    that wide), the rest passed through."""
    if rotary_dim == head_dim:
        return rotate(x, cos, sin, rotary_dim)
    return torch.cat([rotate(x[..., :rotary_dim], cos, sin, rotary_dim), x[..., rotary_dim:]], dim=-1)
