"""Test data: HF ``tokenizer.json`` folders rebuilt from llama.cpp's real vocabulary files.

Each ``ggml-vocab-X.gguf`` (tests/real_vocab.py) holds the tokens, token types, scores, merges and
the name of the pre-tokenizer of a HF tokenizer. ``rebuild(name)`` writes a tokenizer folder from
it with the GGUF importer's rebuild (llmexport.source.importers.gguf.tokenizer); flags a GGUF file
does not keep (Phi-3's ``rstrip``) are set as the real tokenizer.json files have them (``SPECS``).
tests/test_tokenizer_real_vocab.py proves each rebuild against the ``.inp``/``.out`` ids HF produced.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmexport.source.importers.gguf.tokenizer import (
    BPE_PRE,
    DEEPSEEK_CODER_SPLITS,
    DEEPSEEK_LLM_SPLITS,
    GEMMA4,
    SPM,
    Spec,
    with_rstrip,
)
from llmexport.source.importers.gguf.tokenizer import tokenizer_json as gguf_tokenizer_json

from real_vocab import real_vocab

__all__ = ["DEEPSEEK_CODER_SPLITS", "DEEPSEEK_LLM_SPLITS", "SPECS", "rebuild", "tokenizer_json"]

#: Phi-3's added tokens with ``rstrip`` (microsoft/Phi-3-mini-4k-instruct tokenizer.json).
PHI3_RSTRIP = ("</s>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
               "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>")

SPECS: dict[str, Spec] = {
    "gemma-4": GEMMA4,
    **{name: BPE_PRE[name] for name in ("llama-bpe", "qwen2", "qwen35", "gpt-2", "deepseek-llm", "deepseek-coder",
                                        "falcon", "starcoder", "command-r")},
    "llama-spm": SPM,
    "phi-3": with_rstrip(SPM, PHI3_RSTRIP),
}


def tokenizer_json(name: str) -> dict[str, Any]:
    """The rebuilt tokenizer.json of ``ggml-vocab-{name}.gguf``."""
    meta = dict(real_vocab(name).metadata, **{"tokenizer.ggml.add_bos_token": False})
    return gguf_tokenizer_json(meta, name, SPECS[name])


def rebuild(name: str, folder: Path) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` of ``name`` into ``folder``."""
    meta = real_vocab(name).metadata
    tokens = meta["tokenizer.ggml.tokens"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json(name), ensure_ascii=False), encoding="utf-8")

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[idx] if isinstance(idx, int) and 0 <= idx < len(tokens) else None

    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": token("bos"), "eos_token": token("eos"),
              "unk_token": token("unknown"), "add_bos_token": False, "add_eos_token": False,
              "clean_up_tokenization_spaces": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return folder
