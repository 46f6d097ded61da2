"""Shared fixtures: tiny random checkpoints built once per session, never downloaded."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest  # noqa: E402

GEMMA4_SHAPES = ("e2b", "e4b", "31b", "26b-a4b")


@pytest.fixture(scope="session")
def tiny_gemma4(tmp_path_factory):
    """``tiny_gemma4(shape, text_only=False)`` -> path of a cached tiny checkpoint."""
    from llmexport.tiny.gemma4 import build_tiny_gemma4

    cache: dict[tuple, Path] = {}

    def build(shape: str, text_only: bool = False, seed: int = 0) -> Path:
        key = (shape, text_only, seed)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"gemma4-{shape}-{'text' if text_only else 'mm'}-{seed}")
            cache[key] = build_tiny_gemma4(out, shape, seed=seed, text_only=text_only)
        return cache[key]

    return build


def _cached_variants(tmp_path_factory, stem: str, builder):
    cache: dict[tuple, Path] = {}

    def build(variant: str, seed: int = 0) -> Path:
        if (variant, seed) not in cache:
            cache[variant, seed] = builder(tmp_path_factory.mktemp(f"{stem}-{variant}-{seed}"), variant, seed=seed)
        return cache[variant, seed]

    return build


@pytest.fixture(scope="session")
def tiny_k2_horizon(tmp_path_factory):
    """``tiny_k2_horizon(variant, seed=0)`` -> path of a cached tiny K2-Horizon checkpoint."""
    from llmexport.tiny.k2_horizon import build_tiny_k2_horizon

    return _cached_variants(tmp_path_factory, "k2", build_tiny_k2_horizon)


@pytest.fixture(scope="session")
def tiny_qwen3_vl(tmp_path_factory) -> Path:
    """The tiny Qwen3-VL checkpoint (llmexport.tiny.qwen3_vl), built once per session."""
    from llmexport.tiny.qwen3_vl import build_tiny_qwen3_vl

    return build_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"))


@pytest.fixture(scope="session")
def tiny_qwen3_vl_moe(tmp_path_factory) -> Path:
    """The tiny Qwen3-VL-MoE checkpoint (llmexport.tiny.qwen3_vl, its expert stacks transposed as
    released), built once per session."""
    from llmexport.tiny.qwen3_vl import build_tiny_qwen3_vl

    return build_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl_moe"), moe=True)


@pytest.fixture(scope="session")
def wide_model(tmp_path_factory):
    """A text-only model whose weight write takes long enough to be interrupted by a signal."""
    from llmexport.tiny.gemma4 import SHAPES, build_gemma4_checkpoint, text_config_dict

    config = text_config_dict(SHAPES["31b"])
    config.update(hidden_size=512, intermediate_size=2048, vocab_size=4096, head_dim=64, global_head_dim=64,
                  num_attention_heads=8, num_key_value_heads=2)
    return build_gemma4_checkpoint(tmp_path_factory.mktemp("wide"), config)


@pytest.fixture(scope="session")
def tiny_decoder(tmp_path_factory):
    """``tiny_decoder(variant, seed=0)`` -> path of a cached tiny Llama/Qwen3/Qwen3-MoE checkpoint
    (variants: llmexport.tiny.decoders.VARIANTS)."""
    from llmexport.tiny.decoders import build_tiny_decoder

    return _cached_variants(tmp_path_factory, "decoder", build_tiny_decoder)


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory):
    """``tiny_gemma3(variant, seed=0)`` -> path of a cached tiny Gemma3 text checkpoint
    (variants: llmexport.tiny.gemma3.VARIANTS)."""
    from llmexport.tiny.gemma3 import build_tiny_gemma3

    return _cached_variants(tmp_path_factory, "gemma3", build_tiny_gemma3)


@pytest.fixture(scope="session")
def tiny_phi3(tmp_path_factory):
    """``tiny_phi3(variant, seed=0)`` -> path of a cached tiny Phi-3 checkpoint (llmexport.tiny.phi3.VARIANTS)."""
    from llmexport.tiny.phi3 import build_tiny_phi3

    return _cached_variants(tmp_path_factory, "phi3", build_tiny_phi3)


@pytest.fixture(scope="session")
def tiny_lfm2(tmp_path_factory):
    """``tiny_lfm2(variant, seed=0)`` -> path of a cached tiny LFM2 / LFM2-MoE checkpoint
    (llmexport.tiny.lfm2.VARIANTS)."""
    from llmexport.tiny.lfm2 import build_tiny_lfm2

    return _cached_variants(tmp_path_factory, "lfm2", build_tiny_lfm2)


@pytest.fixture(scope="session")
def tiny_qwen3_5(tmp_path_factory):
    """``tiny_qwen3_5(variant, seed=0)`` -> path of a cached tiny Qwen3.5 checkpoint
    (variants: llmexport.tiny.qwen3_5.VARIANTS)."""
    from llmexport.tiny.qwen3_5 import build_tiny_qwen3_5

    return _cached_variants(tmp_path_factory, "qwen3_5", build_tiny_qwen3_5)


# --- chat-template test modules: the module's CHAT_RIG(folder) builds its rig -------------------

@pytest.fixture(scope="module")
def chat_rig(request, tmp_path_factory):
    rig = request.module.CHAT_RIG(tmp_path_factory.mktemp("chat-tok"))
    yield rig
    rig.close()


@pytest.fixture(scope="module")
def tok_dir(chat_rig) -> Path:
    return chat_rig.folder


@pytest.fixture(scope="module")
def hf_tok(chat_rig):
    return chat_rig.hf


@pytest.fixture(scope="module")
def runtime(chat_rig):
    return chat_rig.runtime
