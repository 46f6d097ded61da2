"""config.json (runtime defaults) and llm_config.json (model description) for MNN's runtime."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # config.py stays light: the options import it
    from llmexport.mnn.embeddings import EmbeddingRecord
    from llmexport.mnn.weights import LinearRecord

LLM_MODEL = "llm.mnn"
LLM_WEIGHT = "llm.mnn.weight"
TOKENIZER_FILE = "tokenizer.mtok"
#: the norm weights an activation-aware scaling folded (llmexport.calibration.folding), in checkpoint names: the
#: graph holds them as constants; verification's stored-weights reference reads them from here
FOLDED_NORMS = "folded_norms.safetensors"
#: llm_config.json key (llmexport's own; MNN ignores it): true when the graph carries recurrent
#: state (LinearAttention layers) that ``Llm::eraseHistory`` cannot cut back (docs/output-format.md)
RECURRENT_STATE = "recurrent_state"


def cache_can_be_cut(config: Mapping[str, Any]) -> bool:
    """Whether a runner may shorten the runtime's history with ``erase_history``: not for an export
    whose llm_config.json (or the runtime's merged config) says its graph carries recurrent state;
    such a runner resets and prefills the whole history instead."""
    return not config.get(RECURRENT_STATE, False)


class RuntimeProfile(str, Enum):
    """How MNN's runtime executes the quantized linears (what ``PROFILE_KEYS`` below writes to ``config.json``).

    ``FAST``: MNN's low-memory kernels, which keep the 4/8-bit weights packed and quantize each
    linear's input to 8 bits on the fly (``memory: low``); several times faster to decode, at a
    measured logit cost (docs/benchmarks.md). ``EXACT``: weights dequantized to float at load and
    float matmuls (``memory: normal``): the logits of the stored weights, slower and larger in memory.
    """

    FAST = "fast"
    EXACT = "exact"


@dataclass(frozen=True)
class TableKeys:
    """llm_config.json's ``tie_embeddings``: where the runtime reads a quantized token table, in the
    tied lm_head record of llm.mnn.weight or at byte 0 of the table's own file (mnn/embeddings.py)."""

    weight_offset: int
    alpha_offset: int
    alpha_size: int
    quant_bit: int
    quant_block: int
    alpha_dtype: str  # "fp16" or "fp32"

    @classmethod
    def of_record(cls, record: LinearRecord) -> TableKeys:
        """A tied lm_head record read as the token table."""
        return cls(record.weight_offset, record.alpha_offset, record.alpha_bytes, record.bits, record.block,
                   "fp32" if record.alpha_fp32 else "fp16")

    @classmethod
    def of_table(cls, record: EmbeddingRecord) -> TableKeys:
        """A quantized table written at byte 0 of its own file (its alpha is fp32)."""
        return cls(0, record.weight_bytes, record.alpha_bytes, record.bits, record.block, "fp32")

    @classmethod
    def from_config(cls, data: Mapping[str, Any]) -> TableKeys:
        return cls(**{key: data[key] for key in cls.__dataclass_fields__})

    def to_config(self) -> dict[str, Any]:
        return asdict(self)


def embedding_file_name(bits: int) -> str:
    return "embeddings_bf16.bin" if bits == 16 else f"embeddings_int{bits}.bin"


class Precision(str, Enum):
    """config.json's ``precision``: MNN's activation precision. On ARM CPUs with fp16 arithmetic
    ``low`` computes in fp16 (faster, less exact); on x86 ``low`` equals ``normal`` bit for bit.
    Each family ships the one measured to hold on MNN's ARM kernels (docs/benchmarks.md, fp16 on ARM)."""

    LOW = "low"
    NORMAL = "normal"
    HIGH = "high"


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
                   profile: RuntimeProfile = RuntimeProfile.FAST, precision: Precision | None = None) -> dict[str, Any]:
    """config.json: where the files are and how to run them (greedy sampling by default).

    ``overrides`` are the family's keys (its measured default ``precision``); the profile's keys
    and ``precision`` (``--precision``) are applied last, since they are the user's choice."""
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
    if precision is not None:
        config["precision"] = Precision(precision).value
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
