"""Gemma3 and Gemma4 GGUF files (``general.architecture`` ``gemma3``, ``gemma4``): the config keys
llama.cpp's runtime derives rather than reads, recovered as it derives them (``gemma4_config``:
Gemma4's own keys).

``Gemma3Model`` in convert_hf_to_gguf.py (its ``conversion/gemma.py``) writes ``sliding_window``
(unless the HF config's ``sliding_window_pattern`` is 1), ``rope.freq_base`` (the full layers'),
``rope.freq_base_swa`` (the sliding layers'), the full layers' linear ``rope.scaling`` and
``final_logit_softcapping``. It writes no layer pattern and no ``query_pre_attn_scalar``;
llama.cpp's ``src/models/gemma3.cpp`` then runs:

* five sliding layers to one full (``load_swa_pattern(ml, 6)``: layer ``i`` slides unless
  ``i % 6 == 5``), or the file's ``attention.sliding_window_pattern`` (a period, or one flag per layer);
* attention scaled by ``head_dim ** -0.5``, except for a 62-layer file (Gemma 3 27B), scaled by
  ``(hidden / heads) ** -0.5``: the ``query_pre_attn_scalar`` of the released checkpoints;
* a sliding-layer RoPE base of 10000 when the file has none (``llama-hparams.h``), unscaled.

The converter adds 1 to every ``*norm.weight`` (Gemma's RMSNorm multiplies by ``1 + weight``);
``NORM_SHIFT`` takes it off again (llmexport.source.importers.gguf.weights).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from llmexport.errors import InputError
from llmexport.source.importers.gguf.metadata import Metadata, f32

SLIDING, FULL = "sliding_attention", "full_attention"
#: what convert_hf_to_gguf.py added to the norm weights (``Gemma3Model.norm_shift``)
NORM_SHIFT = 1.0
#: llama.cpp's default period of sliding layers (``llama_model_gemma3::load_arch_hparams``)
PATTERN = 6
#: the block count llama.cpp takes for Gemma 3 27B (``LLM_TYPE_27B``), whose scale is hidden / heads
LAYERS_27B = 62
#: llama.cpp's sliding-layer RoPE base when the file names none (``rope_freq_base_train_swa``)
SWA_THETA = 10000.0


def layer_types(meta: Metadata, key: Callable[[str], str], layers: int) -> list[str]:
    """Each layer's attention as llama.cpp runs it (``llama_hparams::set_swa_pattern``)."""
    if not meta.get(key("attention.sliding_window")):
        return [FULL] * layers
    pattern = meta.get(key("attention.sliding_window_pattern"), PATTERN)
    if isinstance(pattern, list):
        if len(pattern) != layers or not all(isinstance(p, bool) for p in pattern):
            raise InputError(f"{meta.where}: metadata key {key('attention.sliding_window_pattern')!r} must list "
                             f"one flag per layer ({layers})")
        return [SLIDING if p else FULL for p in pattern]
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 0:
        raise InputError(f"{meta.where}: metadata key {key('attention.sliding_window_pattern')!r} is {pattern!r}, "
                         "expected a period >= 0 or one flag per layer")
    return [SLIDING if pattern == 0 or i % pattern < pattern - 1 else FULL for i in range(layers)]


def gemma3_config(meta: Metadata, key: Callable[[str], str], config: dict[str, Any],
                  tensors: dict[str, tuple[int, ...]], rope_freqs: np.ndarray | None) -> dict[str, Any]:
    """The Gemma3TextConfig entries of the file beyond the shared ones in ``config``."""
    if rope_freqs is not None:
        raise InputError(f"{meta.where}: tensor 'rope_freqs.weight' is not used by a gemma3 model")
    kinds = layer_types(meta, key, config["num_hidden_layers"])
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": f32(meta.require(key("rope.freq_base"), float))}
    scaling = meta.get(key("rope.scaling.type"), "none")
    if scaling == "linear":
        full.update(rope_type="linear", factor=f32(meta.require(key("rope.scaling.factor"), float)))
    elif scaling != "none":
        raise InputError(f"{meta.where}: metadata key {key('rope.scaling.type')!r} is {scaling!r}, "
                         "expected 'linear' or 'none' (Gemma3's full layers)")
    sliding = {"rope_type": "default", "rope_theta": f32(meta.get(key("rope.freq_base_swa"), SWA_THETA))}
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    scalar = hidden // heads if config["num_hidden_layers"] == LAYERS_27B else config["head_dim"]
    softcap = meta.get(key("final_logit_softcapping"))
    return {"layer_types": kinds, "sliding_window": int(meta.get(key("attention.sliding_window")) or 0) or None,
            "rope_parameters": {FULL: full, SLIDING: sliding}, "query_pre_attn_scalar": scalar,
            "final_logit_softcapping": None if softcap is None else f32(softcap)}


#: the factor llama.cpp gives the unrotated pairs of a full layer (``Gemma4Model.generate_extra_tensors``)
UNROTATED = 1e30


def _per_layer(meta: Metadata, name: str, layers: int) -> list[int]:
    value = meta.get(name)
    values = value if isinstance(value, list) else [value] * layers
    if len(values) != layers or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise InputError(f"{meta.where}: metadata key {name!r} is {value!r}, expected an int or one per layer")
    return values


def _one(meta: Metadata, name: str, values: list[int], what: str) -> int | None:
    found = set(values)
    if len(found) > 1:
        raise InputError(f"{meta.where}: metadata key {name!r} differs between {what} layers ({sorted(found)})")
    return found.pop() if found else None


def _partial_rotary(meta: Metadata, freqs: np.ndarray | None, head_dim: int) -> float:
    """The full layers' ``partial_rotary_factor`` from llama.cpp's factors: 1 for each rotated pair,
    1e30 (no rotation) for the rest."""
    where = f"{meta.where}: tensor 'rope_freqs.weight'"
    if freqs is None:
        raise InputError(f"{meta.where}: tensor 'rope_freqs.weight' is missing (a gemma4 file's full-layer RoPE)")
    freqs = np.asarray(freqs, dtype=np.float32).reshape(-1)
    rotated = int((freqs == 1.0).sum())
    expected = np.array([1.0] * rotated + [UNROTATED] * (head_dim // 2 - rotated), dtype=np.float32)
    if freqs.shape != expected.shape or not np.array_equal(freqs, expected):
        raise InputError(f"{where}: expected {head_dim // 2} factors (global head_dim {head_dim} / 2), "
                         "1 for each rotated pair, then 1e30")
    return 2 * rotated / head_dim


def _k_eq_v(meta: Metadata, kinds: list[str], unshared: int, tensors: dict[str, tuple[int, ...]]) -> bool:
    """Whether the full layers take their values from ``attn_k`` (31B, 26B-A4B: HF's ``attention_k_eq_v``,
    llama.cpp's ``Vcur = wv ? wv * cur : Kcur``): no full layer with its own KV has ``attn_v``. HF's flag
    holds for every full layer, so a file where only some have one is refused."""
    full = [i for i in range(unshared) if kinds[i] == FULL]
    without = [i for i in full if f"blk.{i}.attn_v.weight" not in tensors]
    if without and without != full:
        having = next(i for i in full if i not in without)
        raise InputError(f"{meta.where}: tensor 'blk.{without[0]}.attn_v.weight' is missing, but full layer "
                         f"{having} has one (K=V must hold for every full layer)")
    return bool(without)


def _moe(meta: Metadata, key: Callable[[str], str], layers: int,
         tensors: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """The routed MoE beside the dense MLP (26B-A4B), on every layer as in HF's Gemma4 (``enable_moe_block``):
    ``expert_count``, ``expert_used_count``, ``expert_feed_forward_length`` (an int, or one per layer).
    llama.cpp's graph (src/models/gemma4.cpp) routes as HF's ``Gemma4TextRouter``: softmax, top-k
    renormalised, times ``per_expert_scale`` (``ffn_down_exps.scale``); the converter writes no other key."""
    if not meta.get(key("expert_count")):
        return {"enable_moe_block": False}
    width_name = key("expert_feed_forward_length")
    width = _one(meta, width_name, _per_layer(meta, width_name, layers), "MoE")
    routerless = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    if routerless:
        raise InputError(f"{meta.where}: tensor 'blk.{routerless[0]}.ffn_gate_inp.weight' is missing (a gemma4 "
                         "MoE file routes every layer)")
    return {"enable_moe_block": True, "num_experts": meta.require(key("expert_count"), int),
            "top_k_experts": meta.require(key("expert_used_count"), int), "moe_intermediate_size": width}


def gemma4_config(meta: Metadata, key: Callable[[str], str], config: dict[str, Any],
                  tensors: dict[str, tuple[int, ...]], rope_freqs: np.ndarray | None) -> dict[str, Any]:
    """The Gemma4TextConfig entries of the file (``Gemma4Model.set_gguf_parameters``): one flag per
    layer for the sliding pattern, two head sizes (``key_length`` for the full layers,
    ``key_length_swa``), per-layer KV head counts (the full layers' own count only with K=V, as HF's
    ``num_global_key_value_heads``) and MLP widths (doubled on the KV-shared layers:
    ``use_double_wide_mlp``), PLE width, shared KV layers (E2B/E4B); K=V full layers (31B, 26B-A4B:
    no ``attn_v``); the routed MoE (26B-A4B); the proportional RoPE of the full layers from
    ``rope_freqs``. llama.cpp's attention scale is 1 (as HF's)."""
    n = config["num_hidden_layers"]
    kinds = layer_types(meta, key, n)
    shared = meta.get(key("attention.shared_kv_layers"), 0)
    k_eq_v = _k_eq_v(meta, kinds, n - shared, tensors)
    widths = _per_layer(meta, key("feed_forward_length"), n)
    base, first_shared = widths[0], n - shared
    double = shared > 0 and widths == [base if i < first_shared else 2 * base for i in range(n)]
    if widths != [base] * n and not double:
        raise InputError(f"{meta.where}: metadata key {key('feed_forward_length')!r} is {widths}: neither one width "
                         "nor one doubled on the KV-shared layers")
    kv_name = key("attention.head_count_kv")
    kv = _per_layer(meta, kv_name, n) if kv_name in meta.fields else [config["num_attention_heads"]] * n
    kv_sliding = _one(meta, kv_name, [kv[i] for i in range(n) if kinds[i] == SLIDING], "sliding")
    kv_full = _one(meta, kv_name, [kv[i] for i in range(n) if kinds[i] == FULL], "full")
    if kv_full not in (None, kv_sliding) and kv_sliding is not None and not k_eq_v:
        raise InputError(f"{meta.where}: metadata key {kv_name!r} is {kv}: full layers with other KV heads than "
                         "the sliding ones have K=V in Gemma4 (no 'attn_v'), these have 'attn_v'")
    head_dim, global_head_dim = meta.require(key("attention.key_length_swa"), int), config["head_dim"]
    sliding = {"rope_type": "default", "rope_theta": f32(meta.get(key("rope.freq_base_swa"), SWA_THETA))}
    rotated = meta.get(key("rope.dimension_count_swa"), head_dim)
    if rotated != head_dim:
        sliding["partial_rotary_factor"] = rotated / head_dim
    full = {"rope_type": "proportional", "partial_rotary_factor": _partial_rotary(meta, rope_freqs, global_head_dim),
            "rope_theta": config["rope_parameters"]["rope_theta"]}
    softcap = meta.get(key("final_logit_softcapping"))
    per_layer = meta.get(key("embedding_length_per_layer_input"), 0)
    ple = tensors.get("per_layer_token_embd.weight")
    return {"layer_types": kinds, "sliding_window": int(meta.require(key("attention.sliding_window"), int)),
            "num_kv_shared_layers": shared, "intermediate_size": base, "use_double_wide_mlp": double,
            "num_key_value_heads": kv_sliding if kv_sliding is not None else kv_full,
            "num_global_key_value_heads": kv_full if kv_full not in (None, kv_sliding) else None,
            "head_dim": head_dim, "global_head_dim": global_head_dim,
            "hidden_size_per_layer_input": per_layer,
            "vocab_size_per_layer_input": ple[0] if ple else config["vocab_size"],
            "rope_parameters": {FULL: full, SLIDING: sliding}, "attention_k_eq_v": k_eq_v,
            **_moe(meta, key, n, tensors),
            "final_logit_softcapping": None if softcap is None else f32(softcap)}
