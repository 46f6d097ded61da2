"""One tiny random checkpoint builder per registered ``model_type``.

Every family the exporter registers must have one (tests/test_family_registry.py checks it), so
that the demo, the tests and the benchmarks can build it locally: ``builder(out_dir, seed)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

Builder = Callable[[Path, int], Path]


def _gemma4(text_only: bool) -> Builder:
    def build(out: Path, seed: int) -> Path:
        from llmexport.tiny.gemma4 import build_tiny_gemma4

        return build_tiny_gemma4(out, "e2b", seed=seed, text_only=text_only)

    return build


def _gemma3(vision: bool) -> Builder:
    def build(out: Path, seed: int) -> Path:
        from llmexport.tiny.gemma3 import build_tiny_gemma3

        return build_tiny_gemma3(out, "1b", seed=seed, vision=vision)

    return build


def _phi3(out: Path, seed: int) -> Path:
    from llmexport.tiny.phi3 import build_tiny_phi3

    return build_tiny_phi3(out, "phi4-mini", seed=seed)


def _k2_horizon(out: Path, seed: int) -> Path:
    from llmexport.tiny.k2_horizon import build_tiny_k2_horizon

    return build_tiny_k2_horizon(out, "sparse", seed=seed)


def _lfm2(variant: str) -> Builder:
    def build(out: Path, seed: int) -> Path:
        from llmexport.tiny.lfm2 import build_tiny_lfm2

        return build_tiny_lfm2(out, variant, seed=seed)

    return build


def _decoder(variant: str) -> Builder:
    def build(out: Path, seed: int) -> Path:
        from llmexport.tiny.decoders import build_tiny_decoder

        return build_tiny_decoder(out, variant, seed=seed)

    return build


def _qwen3_5(variant: str) -> Builder:
    def build(out: Path, seed: int) -> Path:
        from llmexport.tiny.qwen3_5 import build_tiny_qwen3_5

        return build_tiny_qwen3_5(out, variant, seed=seed)

    return build


def _qwen3_vl(moe: bool) -> Builder:
    def build(out: Path, seed: int) -> Path:
        from llmexport.tiny.qwen3_vl import build_tiny_qwen3_vl

        return build_tiny_qwen3_vl(out, seed=seed, moe=moe)

    return build


TINY_BUILDERS: dict[str, Builder] = {
    "gemma3": _gemma3(vision=True),
    "gemma3_text": _gemma3(vision=False),
    "gemma4": _gemma4(text_only=False),
    "gemma4_text": _gemma4(text_only=True),
    "k2_horizon": _k2_horizon,
    "lfm2": _lfm2("dense"),
    "lfm2_moe": _lfm2("moe"),
    "llama": _decoder("llama3"),
    "ministral": _decoder("ministral"),
    "mistral": _decoder("mistral"),
    "qwen2": _decoder("qwen2"),
    "phi3": _phi3,
    "qwen3": _decoder("qwen3"),
    "qwen3_moe": _decoder("qwen3-moe"),
    "qwen3_5": _qwen3_5("qwen3_5"),
    "qwen3_5_moe": _qwen3_5("qwen3_5-moe"),
    "qwen3_5_moe_text": _qwen3_5("qwen3_5-moe-text"),
    "qwen3_5_text": _qwen3_5("qwen3_5-text"),
    "qwen3_vl": _qwen3_vl(moe=False),
    "qwen3_vl_moe": _qwen3_vl(moe=True),
    "smollm3": _decoder("smollm3"),
}
