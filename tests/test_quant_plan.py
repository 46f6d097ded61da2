"""Per-module quantization: recipes, --quant_config files, fp16 routers, lm_head override."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmexport.options import ExportOptions
from llmexport.planning.schemes import requested_scheme, requested_table_bits, tower_scheme
from llmexport.quant.recipes import QuantPlan, QuantRule, load_quant_config, recipe
from llmexport.quant.scheme import QuantMethod, QuantScheme
from llmexport.spec import LinearRole, LinearSpec

DEFAULT = QuantScheme(4, 64)


def spec(name: str, role: LinearRole) -> LinearSpec:
    return LinearSpec(name, 64, 64, role)


MLP = spec("model.layers.0.mlp.down_proj", LinearRole.MLP)
ATTN = spec("model.layers.0.self_attn.q_proj", LinearRole.ATTENTION)
ROUTER = spec("model.layers.0.router.proj", LinearRole.ROUTER)
# K2-Horizon's routers: the MoE gate and the MoVA value router
K2_ROUTERS = (spec("model.layers.1.mlp.gate", LinearRole.ROUTER),
              spec("model.layers.1.self_attn.v_router", LinearRole.ROUTER))
FP16 = QuantScheme(16)
EXPERT = spec("model.layers.0.experts.3.down_proj", LinearRole.EXPERT)
LM = spec("lm_head", LinearRole.LM_HEAD)


def test_mlp4_attn8_recipe():
    plan = recipe("mlp4-attn8", DEFAULT)
    assert plan.scheme_for(MLP) == QuantScheme(4, 32) == plan.scheme_for(EXPERT)
    assert plan.scheme_for(ATTN) == QuantScheme(8, 64) == plan.scheme_for(LM)
    assert {plan.scheme_for(r) for r in (ROUTER, *K2_ROUTERS)} == {FP16}
    assert plan.embed_bit == 8


def test_uniform_recipe_is_the_default_everywhere():
    plan = recipe("uniform", DEFAULT)
    assert {plan.scheme_for(s) for s in (MLP, ATTN, EXPERT, LM)} == {DEFAULT}


SCHEMES = st.builds(QuantScheme, st.sampled_from([2, 3, 4, 8, 16]), st.sampled_from([0, 32, 64, 128]), st.booleans())
BROAD = ("*", "model.*", "*.self_attn.*", "*.mlp.*", "*.layers.*", "*router*", "*gate", "*.router.*", "*_proj")


@given(default=SCHEMES, rule=SCHEMES, pattern=st.sampled_from(BROAD), role=st.sampled_from(
    [r for r in LinearRole if r is not LinearRole.ROUTER]))
def test_routers_stay_fp16_unless_a_rule_names_them(default, rule, pattern, role):
    """Neither the default scheme, nor a recipe, nor a pattern that only happens to match a
    router's name (its last component a wildcard), nor a rule for another role, quantizes it."""
    rules = (QuantRule(pattern, rule), QuantRule(f"role:{role.value}", rule))
    plans = (QuantPlan(default), QuantPlan(default, rules), recipe("mlp4-attn8", default), recipe("uniform", default))
    for plan in plans:
        assert {plan.scheme_for(r) for r in (ROUTER, *K2_ROUTERS)} == {FP16}


@given(rule=SCHEMES, how=st.sampled_from(["role", "name", "exact"]))
def test_a_rule_naming_routers_quantizes_them_at_8_bits_or_more(rule, how):
    for router in (ROUTER, *K2_ROUTERS):
        match = {"role": "role:router", "name": "*." + router.name.rsplit(".", 1)[-1], "exact": router.name}[how]
        got = QuantPlan(DEFAULT, (QuantRule(match, rule),)).scheme_for(router)
        assert got == (rule if rule.is_fp16 or rule.bits >= 8 else QuantScheme(8, rule.block, rule.sym, rule.method))


def test_first_matching_rule_wins():
    plan = QuantPlan(DEFAULT, (QuantRule("*.mlp.down_proj", QuantScheme(8, 128)),
                               QuantRule("role:mlp", QuantScheme(2, 32))))
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
    assert requested_scheme(options, LM) == QuantScheme(8, 128)
    assert requested_table_bits(options) == 8
    assert requested_table_bits(ExportOptions()) == 16
    assert requested_table_bits(ExportOptions(embed_bit=4).with_plan(recipe("mlp4-attn8", DEFAULT))) == 4


def test_tower_schemes_take_the_tower_bits_and_the_default_rest():
    options = ExportOptions(quant=QuantScheme(4, 32, sym=True, method=QuantMethod.HQQ), visual_quant_bit=8,
                            audio_quant_bit=16)
    assert tower_scheme(options, "visual") == QuantScheme(8, 32, sym=True, method=QuantMethod.HQQ)
    assert tower_scheme(options, "audio").is_fp16
