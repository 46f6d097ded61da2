"""The shape every family's typed arguments share (one base for the args dataclasses).

A family's ``*Args`` extends ``DecoderShape`` (the decoder's size and its token table) or, when all
of its layers have one KV head count and head size, ``UniformAttentionShape``. The family adds only
what is its own; the fields here keep one name and meaning in every family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DecoderShape:
    vocab_size: int
    hidden_size: int
    num_heads: int
    eps: float  # the RMSNorm epsilon
    tie_embeddings: bool
    max_position_embeddings: int
    layers: tuple[Any, ...]  # one spec per decoder layer (the family's own LayerSpec)

    @property
    def num_layers(self) -> int:
        return len(self.layers)


@dataclass(frozen=True)
class UniformAttentionShape(DecoderShape):
    intermediate_size: int  # the dense MLP's width (0: every layer is sparse)
    kv_heads: int
    head_dim: int

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim
