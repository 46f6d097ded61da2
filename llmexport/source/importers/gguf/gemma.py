"""Gemma3 GGUF files (``general.architecture`` ``gemma3``): the config keys llama.cpp's runtime
derives rather than reads, recovered as it derives them.

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

from typing import TYPE_CHECKING, Any, Callable

from llmexport.errors import InputError

if TYPE_CHECKING:
    from llmexport.source.importers.gguf.config import Metadata

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


def gemma3_config(meta: Metadata, key: Callable[[str], str], config: dict[str, Any]) -> dict[str, Any]:
    """The Gemma3TextConfig entries of the file beyond the shared ones in ``config``."""
    from llmexport.source.importers.gguf.config import f32

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
