"""The name tables (llmexport/models/tensor_names.py): names formatted and parsed back the same
way, sources of plain and stacked linears, expert templates, and the MLX rename rules the
families build from them."""

from __future__ import annotations

import pytest

from llmexport.models.gemma4.family import Gemma4
from llmexport.models.k2_horizon.family import K2Horizon
from llmexport.models.tensor_names import LinearList, NameTable, match, rename_rule, weight_name
from llmexport.spec import LinearRole, LinearSource, MlxLayout

TABLE = NameTable({
    "attn.q": "{prefix}layers.{layer}.self_attn.q_proj",
    "expert": "{prefix}layers.{layer}.experts.{expert}",
    "expert.down": "{prefix}layers.{layer}.experts.{expert}.down_proj",
    "experts.down": "{prefix}layers.{layer}.experts.down_proj",
    "tied": "m.{layer}.x.{layer}",
}, stacked={"expert.down": "experts.down"}).bind(prefix="model.")


def test_names_are_formatted_and_parsed_back():
    assert TABLE.name("attn.q", layer=3) == "model.layers.3.self_attn.q_proj"
    assert TABLE.bind(layer=3).names(("attn.q", "expert.down"), expert=1) == (
        "model.layers.3.self_attn.q_proj", "model.layers.3.experts.1.down_proj")
    assert TABLE.pattern("expert.down") == "model.layers.{layer}.experts.{expert}.down_proj"
    pattern = weight_name(TABLE.pattern("expert.down"))
    assert match(pattern, "model.layers.12.experts.7.down_proj.weight") == {"layer": 12, "expert": 7}
    assert match(pattern, "model.layers.12.experts.7.up_proj.weight") is None
    assert match(TABLE.pattern("tied"), "m.2.x.2") == {"layer": 2} and match(TABLE.pattern("tied"), "m.2.x.3") is None
    with pytest.raises(KeyError, match="'attn.z'"):
        TABLE.name("attn.z", layer=0)


def test_sources_of_plain_stacked_and_unknown_linears():
    linears = LinearList(TABLE)
    linears.add("attn.q", 8, 8, LinearRole.ATTENTION, bias=True, layer=0)
    linears.add("expert.down", 4, 8, LinearRole.EXPERT, layer=0, expert=2)
    assert [s.name for s in linears.specs] == ["model.layers.0.self_attn.q_proj", "model.layers.0.experts.2.down_proj"]
    assert linears.source("model.layers.0.self_attn.q_proj", "F") == LinearSource(
        "model.layers.0.self_attn.q_proj.weight", None, "model.layers.0.self_attn.q_proj.bias")
    assert linears.source("model.layers.0.experts.2.down_proj", "F") == LinearSource(
        "model.layers.0.experts.down_proj", 2, None)
    with pytest.raises(KeyError, match="F has no placeholder linear 'lm_head'"):
        linears.source("lm_head", "F")


def test_a_transposed_stack_marks_its_rows_sources():
    """``with_transposed``: the stacked linears whose rows are stored [in, out] (Qwen3-VL-MoE)."""
    table = TABLE.with_transposed(["expert.down"])
    assert table.source("expert.down", layer=1, expert=3) == LinearSource("model.layers.1.experts.down_proj", 3,
                                                                          None, True)
    assert not TABLE.source("expert.down", layer=1, expert=3).transposed
    assert not table.source("attn.q", layer=1).transposed


def test_template_names_replace_the_expert_path_by_the_marker():
    assert TABLE.template("expert.down", "expert", "@expert@") == "@expert@.down_proj"
    assert TABLE.template("expert", "expert", "@v@") == "@v@"
    with pytest.raises(ValueError, match="does not lie inside"):
        TABLE.template("attn.q", "expert", "@expert@")


def test_rename_rules_split_and_join():
    layout = MlxLayout((
        rename_rule("a.{layer}.stacked.weight", TABLE.pattern("expert.down") + ".weight", split="expert"),
        rename_rule("a.{layer}.gate.weight", TABLE.pattern("experts.down"), part=(1, 2)),
    ))
    name, rule = layout.hf_name("a.4.stacked.weight")
    assert name == "model.layers.4.experts.{e}.down_proj.weight" and rule is not None and rule.split
    name, rule = layout.hf_name("a.4.gate.weight")
    assert name == "model.layers.4.experts.down_proj" and rule is not None and rule.part == (1, 2)
    assert layout.hf_name("a.x.gate.weight") == ("a.x.gate.weight", None)


@pytest.mark.parametrize("model_type,mlx,hf,split,part", [
    ("gemma4", "language_model.model.layers.3.experts.switch_glu.gate_proj.weight",
     "model.language_model.layers.3.experts.gate_up_proj", False, (0, 2)),
    ("gemma4", "language_model.model.layers.3.experts.switch_glu.up_proj.weight",
     "model.language_model.layers.3.experts.gate_up_proj", False, (1, 2)),
    ("gemma4", "language_model.model.layers.3.experts.switch_glu.down_proj.weight",
     "model.language_model.layers.3.experts.down_proj", False, (0, 1)),
    ("gemma4", "language_model.model.layers.0.self_attn.q_proj.weight",
     "model.language_model.layers.0.self_attn.q_proj.weight", False, (0, 1)),
    ("gemma4", "language_model.lm_head.weight", "lm_head.weight", False, (0, 1)),
    ("gemma4_text", "model.layers.1.experts.switch_glu.up_proj.weight", "model.layers.1.experts.gate_up_proj", False,
     (1, 2)),
    ("gemma4_text", "model.embed_tokens.weight", "model.embed_tokens.weight", False, (0, 1)),
    ("k2_horizon", "model.layers.2.mlp.switch_mlp.up_proj.weight", "model.layers.2.mlp.experts.{e}.up_proj.weight",
     True, (0, 1)),
    ("k2_horizon", "model.layers.2.self_attn.v_experts.weight", "model.layers.2.self_attn.v_experts.{e}.weight", True,
     (0, 1)),
])
def test_the_families_mlx_layouts(model_type, mlx, hf, split, part):
    """mlx-lm's names (mlx_lm/models/gemma4_text.py ``sanitize``; K2-Horizon's port, docs/k2-horizon.md)
    to the HF names the family's table gives."""
    family = K2Horizon if model_type == "k2_horizon" else Gemma4
    name, rule = family.mlx_layout({"model_type": model_type}).hf_name(mlx)
    assert name == hf and rule is not None and (rule.split, rule.part) == (split, part)
