"""A GGUF file's metadata as the HF ``config.json`` it was converted from.

``convert_hf_to_gguf.py`` writes ``{arch}.*`` keys (gguf-py's ``Keys.LLM`` / ``Keys.Attention`` /
``Keys.Rope``) from the HF config; this reads them back for the architectures in ``ARCHITECTURES``.
What the file does not keep is HF's default (``hidden_act`` silu, no MLP bias). llama-3's RoPE
scaling is kept by llama.cpp only as the ``rope_freqs`` tensor (one factor per rotated pair,
``LlamaModel.generate_extra_tensors``): ``llama3_parameters`` finds the llama3 ``rope_parameters``
that give exactly those factors (transformers' GGUF loader drops them and writes ``default``).

Some architectures need more than the common keys (``GgufArchitecture.adapt``):

* ``phi3`` (``Phi3MiniModel`` in the converter's ``conversion/phi.py``): partial rotary is kept as
  ``rope.dimension_count`` (``int(partial_rotary_factor * hidden) // heads``), longrope as the
  ``rope_factors_long`` / ``rope_factors_short`` tensors (fp32 copies of HF's lists) with
  ``rope.scaling.original_context_length`` and ``rope.scaling.attn_factor`` (computed by the
  converter from the two lengths, as transformers' ``_compute_longrope_parameters`` does by
  default), the sliding window as ``attention.sliding_window`` (0 for none).
* ``lfm2`` (``LFM2Model``, ``conversion/lfm2.py``): which layers attend is kept only as
  ``attention.head_count_kv``, one entry per layer, 0 for a short-conv layer; the conv kernel
  length as ``shortconv.l_cache``; the MLP width after LFM2's ``block_auto_adjust_ff_dim``
  arithmetic (so the read-back config has the width and no adjustment); ``norm_eps`` as the rms epsilon.
  ``lfm2moe`` (``LFM2MoeModel``) adds the leading dense layers and the router (``_lfm2_moe``).
* ``gemma3`` and ``gemma4`` (llmexport.source.importers.gguf.gemma): norms stored +1, the layer
  pattern, the two RoPE bases, per-layer arrays of widths and kv heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from llmexport.errors import InputError
from llmexport.source.importers.gguf.gemma import NORM_SHIFT, gemma3_config, gemma4_config
from llmexport.source.importers.gguf.metadata import Metadata, f32

#: an architecture's own keys: (metadata, config so far, tensor shapes, non-HF tensors' values) -> the
#: config changed in place
Adapt = Callable[[Metadata, dict[str, Any], dict[str, tuple[int, ...]], dict[str, np.ndarray]], None]


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
    #: the architecture's own keys (its ``rope_freqs``, per-layer arrays of ``feed_forward_length`` /
    #: ``attention.head_count_kv``, extra tensors); None: the common keys only, ``rope_freqs`` as llama3's
    adapt: Adapt | None = None


def _phi3(meta: Metadata, config: dict[str, Any], tensors: dict[str, tuple[int, ...]],
          extras: dict[str, np.ndarray]) -> None:
    """Phi-3's partial rotary, longrope and sliding window (module docstring)."""
    head_dim, theta = config["head_dim"], config["rope_parameters"]["rope_theta"]
    rotary = meta.get("phi3.rope.dimension_count", head_dim)
    if not isinstance(rotary, int) or not 0 < rotary <= head_dim or rotary % 2:
        raise InputError(f"{meta.where}: metadata key 'phi3.rope.dimension_count' is {rotary!r}, expected an even "
                         f"number of rotated dims up to head_dim {head_dim}")
    long, short = extras.get("rope_factors_long.weight"), extras.get("rope_factors_short.weight")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if long is not None or short is not None:
        rope = _longrope(meta, config, long, short, rotary // 2)
    if rotary != head_dim or long is not None:
        rope["partial_rotary_factor"] = rotary / head_dim
    config["rope_parameters"] = rope
    window = meta.require("phi3.attention.sliding_window", int) if "phi3.attention.sliding_window" in meta.fields else 0
    config["sliding_window"] = window or None


def _longrope(meta: Metadata, config: dict[str, Any], long: np.ndarray | None, short: np.ndarray | None,
              pairs: int) -> dict[str, Any]:
    """HF's longrope ``rope_parameters`` from llama.cpp's factor tensors (``Phi3MiniModel.generate_extra_tensors``)."""
    lists = {}
    for name, factors in (("long", long), ("short", short)):
        if factors is None or np.asarray(factors).reshape(-1).shape[0] != pairs:
            raise InputError(f"{meta.where}: tensor 'rope_factors_{name}.weight' must hold {pairs} factors "
                             f"(rope.dimension_count / 2) beside rope_factors_{'short' if name == 'long' else 'long'}")
        lists[name] = [f32(float(x)) for x in np.asarray(factors, dtype=np.float32).reshape(-1)]
    original = meta.require("phi3.rope.scaling.original_context_length", int)
    rope = {"rope_type": "longrope", "rope_theta": config["rope_parameters"]["rope_theta"],
            "short_factor": lists["short"], "long_factor": lists["long"], "original_max_position_embeddings": original}
    scale = config["max_position_embeddings"] / original
    default = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    key = "phi3.rope.scaling.attn_factor"
    stored = meta.require(key, (int, float)) if key in meta.fields else default
    if not math.isclose(float(np.float32(default)), float(stored), rel_tol=1e-6):  # not the converter's own value
        rope["attention_factor"] = f32(stored)
    config["original_max_position_embeddings"] = original
    return rope


def _lfm2(meta: Metadata, config: dict[str, Any], tensors: dict[str, tuple[int, ...]],
          extras: dict[str, np.ndarray]) -> None:
    """LFM2's layer kinds, conv kernel length and norm epsilon (module docstring)."""
    arch = architecture_of(meta)
    kv = meta.require(f"{arch}.attention.head_count_kv", list)
    attending = sorted({n for n in kv if n})
    if len(kv) != config["num_hidden_layers"] or len(attending) != 1 or not all(isinstance(n, int) for n in kv):
        raise InputError(f"{meta.where}: metadata key '{arch}.attention.head_count_kv' is {kv!r}, expected one "
                         f"kv head count per layer ({config['num_hidden_layers']}), 0 for the short-conv layers")
    config.update(num_key_value_heads=attending[0], layer_types=["full_attention" if n else "conv" for n in kv],
                  conv_L_cache=meta.require(f"{arch}.shortconv.l_cache", int), conv_bias=False,
                  norm_eps=config.pop("rms_norm_eps"), block_auto_adjust_ff_dim=False)
    del config["hidden_act"]


#: ``llama_expert_gating_func_type``'s sigmoid (llama.cpp's LFM2-MoE graph reads the gating from the file)
_SIGMOID = 2


def _lfm2_moe(meta: Metadata, config: dict[str, Any], tensors: dict[str, tuple[int, ...]],
              extras: dict[str, np.ndarray]) -> None:
    """LFM2-MoE (``LFM2MoeModel.set_gguf_parameters``): LFM2's keys, the leading dense layers, the
    sigmoid router with its selection bias when ``exp_probs_b`` is there. The converter writes neither
    ``norm_topk_prob`` nor ``routed_scaling_factor``: llama.cpp's graph (src/models/lfm2.cpp,
    ``build_moe_ffn(..., norm_w=true, expert_weights_scale)``) renormalises and scales by
    ``expert_weights_scale`` (1 when absent), which is the model read back."""
    _lfm2(meta, config, tensors, extras)
    gating = meta.get("lfm2moe.expert_gating_func", _SIGMOID)
    if gating != _SIGMOID:
        raise InputError(f"{meta.where}: metadata key 'lfm2moe.expert_gating_func' is {gating!r}, "
                         f"expected {_SIGMOID} (sigmoid, LFM2-MoE's router)")
    dense = meta.require("lfm2moe.leading_dense_block_count", int)
    config.update(num_dense_layers=dense, norm_topk_prob=True,
                  routed_scaling_factor=f32(meta.get("lfm2moe.expert_weights_scale", 1.0)) or 1.0,
                  use_expert_bias=any(name.endswith(".exp_probs_b.bias") for name in tensors))


def _keyed(entries: Callable[..., dict[str, Any]]) -> Adapt:
    """A Gemma ``*_config`` (llmexport.source.importers.gguf.gemma: metadata, its key function, the
    config so far, tensor shapes, ``rope_freqs``) -> entries) as an ``Adapt``."""
    def adapt(meta: Metadata, config: dict[str, Any], tensors: dict[str, tuple[int, ...]],
              extras: dict[str, np.ndarray]) -> None:
        arch = architecture_of(meta)
        config.update(entries(meta, lambda name: f"{arch}.{name}", config, tensors, extras.get("rope_freqs.weight")))
    return adapt


ARCHITECTURES: dict[str, GgufArchitecture] = {
    "llama": GgufArchitecture("llama", "LlamaForCausalLM", "attention_bias", (("mlp_bias", False),), permuted=True),
    "qwen2": GgufArchitecture("qwen2", "Qwen2ForCausalLM"),
    "qwen3": GgufArchitecture("qwen3", "Qwen3ForCausalLM", "attention_bias"),
    # llama.cpp's qwen3moe graph renormalises the top-k weights and routes every layer
    # (src/models/qwen3moe.cpp; transformers' GGUF loader sets norm_topk_prob for the same reason)
    "qwen3moe": GgufArchitecture("qwen3_moe", "Qwen3MoeForCausalLM", "attention_bias", (
        ("norm_topk_prob", True), ("decoder_sparse_step", 1), ("mlp_only_layers", ())), moe=True),
    # the converter writes no key for biases: Phi3's linears have none
    "phi3": GgufArchitecture("phi3", "Phi3ForCausalLM", None, adapt=_phi3),
    "lfm2": GgufArchitecture("lfm2", "Lfm2ForCausalLM", None, adapt=_lfm2),
    "lfm2moe": GgufArchitecture("lfm2_moe", "Lfm2MoeForCausalLM", None, moe=True, adapt=_lfm2_moe),
    # Gemma3ForCausalLM (Gemma 3 270M, 1B; the text decoder of 4B-27B): llmexport.source.importers.gguf.gemma
    "gemma3": GgufArchitecture("gemma3_text", "Gemma3ForCausalLM", "attention_bias",
                               activation=("hidden_activation", "gelu_pytorch_tanh"), norm_shift=NORM_SHIFT,
                               adapt=_keyed(gemma3_config)),
    # Gemma4ForCausalLM: E2B/E4B (PLE, KV sharing), 31B (K=V), 26B-A4B (MoE): llmexport.source.importers.gguf.gemma
    "gemma4": GgufArchitecture("gemma4_text", "Gemma4ForCausalLM", "attention_bias",
                               activation=("hidden_activation", "gelu_pytorch_tanh"), adapt=_keyed(gemma4_config)),
}


def architecture_of(meta: Metadata) -> str:
    """The file's ``general.architecture``, one of ``ARCHITECTURES``."""
    arch = meta.require("general.architecture", str)
    if arch not in ARCHITECTURES:
        raise InputError(f"{meta.where}: general.architecture {arch!r} is not supported "
                         f"(supported: {', '.join(ARCHITECTURES)})")
    return arch


def hf_config(meta: Metadata, tensors: dict[str, tuple[int, ...]], extras: dict[str, np.ndarray]) -> dict[str, Any]:
    """The HF config of the file: ``tensors`` maps GGUF tensor names to their HF shapes
    (``[out, in]``), ``extras`` the values of its tensors that are no HF tensor (llama-3's
    ``rope_freqs``, Phi-3's longrope factors: llmexport.source.importers.gguf.names ``NOT_TENSORS``)."""
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
    if "rope_freqs.weight" in extras and spec.adapt is None:
        rope = llama3_parameters(extras["rope_freqs.weight"], theta, head_dim,
                                 f"{meta.where}: tensor 'rope_freqs.weight'")
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
    if spec.adapt is not None:
        spec.adapt(meta, config, tensors, extras)
    return config


def _first(meta: Metadata, name: str, spec: GgufArchitecture, default: int | None = None) -> int:
    """An integer key, or the first layer's value of a per-layer array (which an architecture with
    its own ``adapt`` resolves; an array whose values differ is refused for the others)."""
    value = meta.get(name, default) if default is not None else meta.require(name, (int, list))
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        if spec.adapt is None and len(set(value)) > 1:
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
