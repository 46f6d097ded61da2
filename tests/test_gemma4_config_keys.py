"""Gemma4: the export reads config.json the way transformers' Gemma4TextConfig does.

For each tiny shape, written both the way transformers saves it (``per_layer_config``) and in the
constructor form (``global_head_dim`` / ``num_global_key_value_heads``, no ``per_layer_config``),
and with the keys transformers treats specially (a last layer that is not full attention, a
``factor`` on a default RoPE block), the parsed per-layer head_dim, KV heads, layer kinds and
RoPE inverse frequencies equal those of HF's config and rotary embedding.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

from llmexport.errors import InputError
from llmexport.models.gemma4.args import FULL, SLIDING, parse_text_args
from llmexport.tiny.gemma4 import SHAPES, text_config_dict

WHERE = "/models/gemma4/config.json"


def _constructor_form(shape: str) -> dict:
    return {k: v for k, v in text_config_dict(SHAPES[shape]).items() if v is not None}


def _saved_form(shape: str) -> dict:
    return Gemma4TextConfig(**_constructor_form(shape)).to_dict()


def _last_layer_sliding(cfg: dict) -> dict:
    return {**cfg, "layer_types": [*cfg["layer_types"][:-1], SLIDING]}


def _default_rope_with_factor(cfg: dict) -> dict:
    rope = {kind: dict(p) for kind, p in cfg["rope_parameters"].items()}
    rope[SLIDING]["factor"] = 4.0
    rope[FULL]["factor"] = 2.0
    return {**cfg, "rope_parameters": rope}


FORMS = {"saved": _saved_form, "constructor": _constructor_form,
         "last-sliding": lambda s: _last_layer_sliding(_constructor_form(s)),
         "rope-factor": lambda s: _default_rope_with_factor(_saved_form(s))}


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_parsed_layers_and_rope_equal_transformers(shape, form):
    cfg = FORMS[form](shape)
    ours = parse_text_args(dict(cfg), "model.language_model.", WHERE)
    hf = Gemma4TextConfig(**cfg)
    assert [layer.kind for layer in ours.layers] == hf.layer_types
    for layer in ours.layers:
        resolved = hf.per_layer_config[layer.index]
        assert (layer.head_dim, layer.kv_heads) == (resolved.head_dim, resolved.num_key_value_heads), layer.index
    rotary = Gemma4TextRotaryEmbedding(hf)
    for kind, spec in ours.rope.items():
        assert torch.equal(spec.inv_freq(), getattr(rotary, f"{kind}_inv_freq")), kind


def test_non_causal_text_attention_is_refused():
    with pytest.raises(InputError, match="'use_bidirectional_attention' is 'all'"):
        parse_text_args({**_saved_form("e2b"), "use_bidirectional_attention": "all"}, "model.", WHERE)
