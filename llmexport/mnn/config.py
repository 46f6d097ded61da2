"""config.json (runtime defaults) and llm_config.json (model description) for MNN's runtime."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmexport.options import RuntimeProfile

LLM_MODEL = "llm.mnn"
LLM_WEIGHT = "llm.mnn.weight"
TOKENIZER_FILE = "tokenizer.mtok"


def embedding_file_name(bits: int) -> str:
    return "embeddings_bf16.bin" if bits == 16 else f"embeddings_int{bits}.bin"


# What each runtime profile sets in config.json. MNN 3.6.1's CPU backend with ``memory: low``
# keeps quantized weights packed and runs int8 x int4/int8 kernels on inputs it quantizes per
# call; ``memory: normal`` dequantizes every weight to float when the model loads.
PROFILE_KEYS: dict[RuntimeProfile, dict[str, str]] = {
    RuntimeProfile.FAST: {"memory": "low"},
    RuntimeProfile.EXACT: {"memory": "normal"},
}


#: set_config of a run on MNN's exact kernels, whatever profile the export ships (what verification
#: uses to prove the graph, the records and the towers' prompts; the fast kernels' own noise is
#: judged separately)
EXACT_KERNELS: dict[str, Any] = {"thread_num": 2, **PROFILE_KEYS[RuntimeProfile.EXACT]}


def profile_of(config: dict[str, Any]) -> RuntimeProfile:
    """The profile an exported config.json runs with (what verification must judge)."""
    for profile, keys in PROFILE_KEYS.items():
        if all(config.get(key) == value for key, value in keys.items()):
            return profile
    return RuntimeProfile.EXACT  # any other memory mode dequantizes at load, as "exact" does


def runtime_config(overrides: dict[str, Any], thread_num: int, embedding_file: str | None,
                   profile: RuntimeProfile = RuntimeProfile.FAST) -> dict[str, Any]:
    """config.json: where the files are and how to run them (greedy sampling by default).

    ``overrides`` are the family's keys (e.g. Gemma4's fp32 activations); the profile's keys
    are applied last, since the profile is the user's choice."""
    config: dict[str, Any] = {
        "llm_model": LLM_MODEL,
        "llm_weight": LLM_WEIGHT,
        "tokenizer_file": TOKENIZER_FILE,
        "backend_type": "cpu",
        "thread_num": thread_num,
        "precision": "low",
        "sampler_type": "greedy",
        "max_new_tokens": 512,
        "use_mmap": False,
    }
    if embedding_file:
        config["embedding_file"] = embedding_file
    config.update(overrides)
    config.update(PROFILE_KEYS[profile])
    return config


def llm_config(family: dict[str, Any], files: dict[str, Any],
               template_context: dict[str, Any] | None = None) -> dict[str, Any]:
    """llm_config.json: the family's keys (hidden_size, layer_nums, attention type, ...) plus
    what the export wrote (the token table's hidden_size and tie_embeddings), and the chat
    template's variables (``jinja.context``: the runtime passes its keys to the template)."""
    config: dict[str, Any] = {"attention_mask": "float", "is_mrope": False}
    config.update(family)
    config.update(files)
    if template_context and isinstance(config.get("jinja"), dict):
        jinja = dict(config["jinja"])
        jinja["context"] = {**jinja.get("context", {}), **template_context}
        config["jinja"] = jinja
    return config


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")
