"""A GGUF file's metadata as the HF ``config.json`` it was converted from.

``convert_hf_to_gguf.py`` writes ``{arch}.*`` keys (gguf-py's ``Keys.LLM`` / ``Keys.Attention`` /
``Keys.Rope``) from the HF config; this reads them back for the architectures in ``ARCHITECTURES``.
What the file does not keep is HF's default (``hidden_act`` silu, no MLP bias). llama-3's RoPE
scaling is kept by llama.cpp only as the ``rope_freqs`` tensor (one factor per rotated pair,
``LlamaModel.generate_extra_tensors``): ``llama3_parameters`` finds the llama3 ``rope_parameters``
that give exactly those factors (transformers' GGUF loader drops them and writes ``default``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from llmexport.errors import InputError
from llmexport.source.importers.gguf.gemma import NORM_SHIFT, gemma3_config, gemma4_config
from llmexport.source.importers.gguf.metadata import Metadata, f32


@dataclass(frozen=True)
class GgufArchitecture:
    """One ``general.architecture``: the HF model type and class it stands for."""

    model_type: str
    hf_class: str
    qkv_bias_key: str | None = None  # the config key saying q/k/v have biases (None: the class always has them)
    fixed: tuple[tuple[str, Any], ...] = ()  # config entries llama.cpp does not write, as HF's converter had them
    permuted: bool = False  # convert_hf_to_gguf.py permuted q/k rows for RoPE (llmexport.source.importers.gguf.names)
    moe: bool = False  # routed experts: ``expert_count``, ``expert_used_count``, ``expert_feed_forward_length``
    activation: tuple[str, str] = ("hidden_act", "silu")  # the config key of the MLP activation, its value
    norm_shift: float = 0.0  # what convert_hf_to_gguf.py added to every ``*norm.weight`` (taken off on read)
    #: the architecture's own config entries: (metadata, its key function, the shared entries, tensor
    #: shapes, the ``rope_freqs`` tensor) -> entries; it reads ``rope_freqs`` (else: llama3 factors) and
    #: the per-layer arrays ``feed_forward_length`` / ``attention.head_count_kv`` may hold
    extra: Callable[[Metadata, Callable[[str], str], dict[str, Any], dict[str, tuple[int, ...]], np.ndarray | None],
                    dict[str, Any]] | None = None


ARCHITECTURES: dict[str, GgufArchitecture] = {
    "llama": GgufArchitecture("llama", "LlamaForCausalLM", "attention_bias", (("mlp_bias", False),), permuted=True),
    "qwen2": GgufArchitecture("qwen2", "Qwen2ForCausalLM"),
    "qwen3": GgufArchitecture("qwen3", "Qwen3ForCausalLM", "attention_bias"),
    # llama.cpp's qwen3moe graph renormalises the top-k weights and routes every layer
    # (src/models/qwen3moe.cpp; transformers' GGUF loader sets norm_topk_prob for the same reason)
    "qwen3moe": GgufArchitecture("qwen3_moe", "Qwen3MoeForCausalLM", "attention_bias", (
        ("norm_topk_prob", True), ("decoder_sparse_step", 1), ("mlp_only_layers", ())), moe=True),
    # Gemma3ForCausalLM (Gemma 3 270M, 1B; the text decoder of 4B-27B): llmexport.source.importers.gguf.gemma
    "gemma3": GgufArchitecture("gemma3_text", "Gemma3ForCausalLM", "attention_bias",
                               activation=("hidden_activation", "gelu_pytorch_tanh"), norm_shift=NORM_SHIFT,
                               extra=gemma3_config),
    # Gemma4ForCausalLM, E2B/E4B-style text (PLE, KV sharing): llmexport.source.importers.gguf.gemma
    "gemma4": GgufArchitecture("gemma4_text", "Gemma4ForCausalLM", "attention_bias",
                               activation=("hidden_activation", "gelu_pytorch_tanh"), extra=gemma4_config),
}


def architecture_of(meta: Metadata) -> str:
    """The file's ``general.architecture``, one of ``ARCHITECTURES``."""
    arch = meta.require("general.architecture", str)
    if arch not in ARCHITECTURES:
        raise InputError(f"{meta.where}: general.architecture {arch!r} is not supported "
                         f"(supported: {', '.join(ARCHITECTURES)})")
    return arch


def hf_config(meta: Metadata, tensors: dict[str, tuple[int, ...]], rope_freqs: np.ndarray | None) -> dict[str, Any]:
    """The HF config of the file: ``tensors`` maps GGUF tensor names to their HF shapes
    (``[out, in]``), ``rope_freqs`` is llama-3's factor tensor when the file has one."""
    arch = architecture_of(meta)
    spec = ARCHITECTURES[arch]

    def key(name: str) -> str:
        return f"{arch}.{name}"

    heads = meta.require(key("attention.head_count"), int)
    hidden = meta.require(key("embedding_length"), int)
    head_dim = meta.get(key("attention.key_length"), hidden // heads)
    if "token_embd.weight" not in tensors:
        raise InputError(f"{meta.where}: tensor 'token_embd.weight' is missing")
    theta = f32(meta.get(key("rope.freq_base"), 10000.0))
    rope: dict[str, Any] = {"rope_theta": theta, "rope_type": "default"}
    if rope_freqs is not None and spec.extra is None:
        rope = llama3_parameters(rope_freqs, theta, head_dim, f"{meta.where}: tensor 'rope_freqs.weight'")
    config: dict[str, Any] = {
        "architectures": [spec.hf_class], "model_type": spec.model_type,
        "vocab_size": int(tensors["token_embd.weight"][0]), "hidden_size": hidden,
        "intermediate_size": _first(meta, key("feed_forward_length"), spec),
        "num_hidden_layers": meta.require(key("block_count"), int),
        "num_attention_heads": heads,
        "num_key_value_heads": _first(meta, key("attention.head_count_kv"), spec, heads),
        "head_dim": head_dim,
        "max_position_embeddings": meta.require(key("context_length"), int),
        "rms_norm_eps": f32(meta.require(key("attention.layer_norm_rms_epsilon"), float)),
        spec.activation[0]: spec.activation[1], "rope_parameters": rope,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "dtype": "float32",
    }
    if spec.moe:
        config.update(num_experts=meta.require(key("expert_count"), int),
                      num_experts_per_tok=meta.require(key("expert_used_count"), int),
                      moe_intermediate_size=meta.require(key("expert_feed_forward_length"), int))
    if spec.qkv_bias_key is not None:
        config[spec.qkv_bias_key] = "blk.0.attn_q.bias" in tensors
    config.update(spec.fixed)
    if spec.extra is not None:
        config.update(spec.extra(meta, key, config, tensors, rope_freqs))
    return config


def _first(meta: Metadata, name: str, spec: GgufArchitecture, default: int | None = None) -> int:
    """An integer key, or the first layer's value of a per-layer array (which an architecture with
    its own ``extra`` entries resolves; an array whose values differ is refused for the others)."""
    value = meta.get(name, default) if default is not None else meta.require(name, (int, list))
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        if spec.extra is None and len(set(value)) > 1:
            raise InputError(f"{meta.where}: metadata key {name!r} differs between layers ({value}), "
                             f"which a {spec.model_type} model does not")
        return value[0]
    if not isinstance(value, int) or isinstance(value, bool):
        raise InputError(f"{meta.where}: metadata key {name!r} is {value!r}, expected int")
    return value


#: llama3 RoPE settings tried when the factors show too few points of the smooth band to fit them
#: (Llama 3.1 and 3.2's own settings, and the same bands around other original context lengths)
_LLAMA3_BANDS = [(1.0, 4.0, 2 ** k) for k in range(10, 18)]


def _llama3_factors(theta: float, dim: int, factor: float, low: float, high: float, original: float) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` for these llama3 settings (``LlamaModel.generate_extra_tensors``)."""
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def llama3_parameters(freqs: np.ndarray, theta: float, dim: int, where: str) -> dict[str, Any]:
    """The llama3 ``rope_parameters`` whose factors equal ``freqs`` (to fp32 rounding); InputError
    when no llama3 setting gives them."""
    freqs = np.asarray(freqs, dtype=np.float32).reshape(-1)
    if freqs.shape[0] != dim // 2:
        raise InputError(f"{where}: {freqs.shape[0]} factors, expected {dim // 2} (head_dim {dim} / 2)")
    factor = float(freqs.max())
    candidates = list(_LLAMA3_BANDS)
    wavelens = np.array([2 * math.pi * theta ** (i / dim) for i in range(0, dim, 2)])
    smooth = (freqs > 1) & (freqs < factor)
    # fit the band: smooth = original / wavelen / (high - low) - low / (high - low), with low = 1
    if smooth.sum() >= 2 and factor > 1:
        s = (1 / freqs[smooth] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelens[smooth], s, 1)
        high = 1 - 1 / intercept if intercept else 0.0
        if high > 1:  # after the released settings; rounded as a config would write it
            candidates.append((1.0, round(float(high), 4), round(float(slope * (high - 1)))))
    for low, high, original in candidates:
        got = _llama3_factors(theta, dim, factor, low, high, original)
        if np.allclose(got, freqs, rtol=1e-6, atol=0):
            return {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": int(round(original))}
    raise InputError(f"{where}: these RoPE factors are no llama3 scaling this exporter can express")
