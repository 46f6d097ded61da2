"""Per-module quantization: recipes, --quant_config files, router floor, lm_head override."""

from __future__ import annotations

import json

import pytest

from llmexport.options import ExportOptions
from llmexport.quant.recipes import QuantPlan, QuantRule, load_quant_config, recipe
from llmexport.quant.scheme import QuantMethod, QuantScheme
from llmexport.spec import LinearRole, LinearSpec

DEFAULT = QuantScheme(4, 64)


def spec(name: str, role: LinearRole) -> LinearSpec:
    return LinearSpec(name, 64, 64, role)


MLP = spec("model.layers.0.mlp.down_proj", LinearRole.MLP)
ATTN = spec("model.layers.0.self_attn.q_proj", LinearRole.ATTENTION)
ROUTER = spec("model.layers.0.router.proj", LinearRole.ROUTER)
EXPERT = spec("model.layers.0.experts.3.down_proj", LinearRole.EXPERT)
LM = spec("lm_head", LinearRole.LM_HEAD)


def test_mlp4_attn8_recipe():
    plan = recipe("mlp4-attn8", DEFAULT)
    assert plan.scheme_for(MLP) == QuantScheme(4, 32) == plan.scheme_for(EXPERT)
    assert plan.scheme_for(ATTN) == QuantScheme(8, 64) == plan.scheme_for(LM) == plan.scheme_for(ROUTER)
    assert plan.embed_bit == 8


def test_uniform_recipe_is_the_default_everywhere():
    plan = recipe("uniform", DEFAULT)
    assert {plan.scheme_for(s) for s in (MLP, ATTN, EXPERT, LM)} == {DEFAULT}


def test_router_never_below_8_bits():
    assert QuantPlan(QuantScheme(4, 64)).scheme_for(ROUTER).bits == 8
    assert QuantPlan(QuantScheme(2, 64)).scheme_for(ROUTER).bits == 8
    assert QuantPlan(QuantScheme(16, 64)).scheme_for(ROUTER).bits == 16


def test_first_matching_rule_wins():
    plan = QuantPlan(DEFAULT, (QuantRule("*.mlp.down_proj", QuantScheme(8, 128)), QuantRule("role:mlp", QuantScheme(2, 32))))
    assert plan.scheme_for(MLP) == QuantScheme(8, 128)
    assert plan.scheme_for(spec("m.layers.0.mlp.up_proj", LinearRole.MLP)) == QuantScheme(2, 32)
    assert plan.scheme_for(ATTN) == DEFAULT


def test_quant_config_file(tmp_path):
    path = tmp_path / "q.json"
    path.write_text(json.dumps({"default": {"bits": 8}, "embed_bit": 4, "rules": [
        {"match": "role:mlp", "bits": 4, "block": 32, "method": "hqq"},
        {"match": "*.q_proj", "sym": True}]}))
    plan = load_quant_config(path, DEFAULT)
    assert plan.scheme_for(MLP) == QuantScheme(4, 32, method=QuantMethod.HQQ)
    assert plan.scheme_for(ATTN) == QuantScheme(8, 64, sym=True)
    assert plan.scheme_for(LM) == QuantScheme(8, 64) and plan.embed_bit == 4


@pytest.mark.parametrize("content, needle", [
    ("{nope", "malformed JSON"),
    (json.dumps({"rules": [{"bits": 4}]}), "needs a 'match'"),
    (json.dumps({"rules": [{"match": "role:ffn", "bits": 4}]}), "unknown role 'ffn'"),
    (json.dumps({"rules": [{"match": "*", "bits": 5}]}), "bits must be one of"),
    (json.dumps({"rules": [{"match": "*", "blocks": 5}]}), "unknown key"),
    (json.dumps({"default": {"method": "gptq"}}), "method must be one of"),
])
def test_bad_quant_config_names_file_and_problem(tmp_path, content, needle):
    path = tmp_path / "q.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=needle) as info:
        load_quant_config(path, DEFAULT)
    assert str(path) in str(info.value)


def test_options_lm_override_and_table_bits():
    options = ExportOptions(quant=DEFAULT, lm_quant=QuantScheme(8, 128)).with_plan(recipe("mlp4-attn8", DEFAULT))
    assert options.scheme_for(LM) == QuantScheme(8, 128)
    assert options.table_bits == 8
    assert ExportOptions().table_bits == 16
    assert ExportOptions(embed_bit=4).with_plan(recipe("mlp4-attn8", DEFAULT)).table_bits == 4
