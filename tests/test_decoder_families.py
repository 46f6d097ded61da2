"""Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral and SmolLM3: the rewrite (eager) vs transformers, ONNX (onnxruntime) vs the
rewrite, the MNN-flavoured trace, config reading and the checkpoint checks."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmexport.errors import InputError
from llmexport.quant.recipes import recipe
from llmexport.quant.scheme import QuantScheme
from llmexport.source.checkpoint import Checkpoint
from llmexport.source.loading import open_architecture
from llmexport.spec import LinearRole
from llmexport.tiny.decoders import FAMILIES, VARIANTS, build_decoder_checkpoint, random_config
from llmexport.trace.eager import bind_weights

from families import parametrize
from helpers import (
    assert_alteration_shows,
    assert_config_edit_is_typed,
    assert_reference_onnx_matches_eager,
    custom_nodes,
    edit_checkpoint,
    rewrite_and_reference,
    set_or_delete,
)

MODEL_TYPE = {variant: family for variant, (family, _) in VARIANTS.items()}
RANDOM_POINTS = [(family, seed) for family in sorted(FAMILIES) for seed in range(300, 304)]


@parametrize("rewrite", "variant", sorted(VARIANTS), MODEL_TYPE.get)
def test_rewrite_matches_hf(tiny_decoder, variant):
    torch.manual_seed(1)
    ids = torch.randint(5, 440, (21,))
    arch, _, ours, ref = rewrite_and_reference(tiny_decoder(variant), ids)
    assert arch.checkpoint.model_type == MODEL_TYPE[variant]
    assert ours.shape == ref.shape == (21, 512)
    assert ref.abs().max() > 1.0  # not degenerate
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("variant, alter", [
    ("qwen3", lambda g: g.layers[2].self_attn.k_norm.weight.mul_(1.05)),
    # the inverse frequencies without Llama-3's scaling
    ("llama3", lambda g: g.inv_freq.copy_(1.0 / 500000.0 ** (torch.arange(0, 16, 2).float() / 16))),
    ("qwen3-moe", lambda g: g.layers[1].mlp.gate.weight.mul_(1.5)),
    # sliding layers reading the full-attention slice; Qwen2's q bias
    ("qwen2", lambda g: setattr(g, "sliding", (False, False, True, False))),
    ("mistral", lambda g: setattr(g, "sliding", (True, True, False, True))),
    ("qwen2", lambda g: g.layers[1].self_attn.q_proj.bias.mul_(3.0)),
    # a NoPE layer rotating q/k
    ("smollm3", lambda g: setattr(g.layers[1].self_attn, "rope", True)),
])
def test_parity_check_detects_a_change(tiny_decoder, variant, alter):
    """Guards against a vacuous comparison: a q/k norm gamma, the Llama-3 frequency rescaling and
    the router, a sliding layer's window, a q/k/v bias and a NoPE layer each change the logits."""
    torch.manual_seed(1)
    assert_alteration_shows(tiny_decoder(variant), alter, torch.randint(5, 440, (21,)))


@pytest.mark.parametrize("family, seed", RANDOM_POINTS)
def test_random_configs_match_hf(tmp_path, family, seed):
    config = random_config(family, seed)
    path = build_decoder_checkpoint(tmp_path / "model", family, config, seed=seed,
                                    dtype=torch.float32 if seed % 2 else torch.bfloat16)
    torch.manual_seed(seed)
    ids = torch.randint(5, 440, (13,))
    arch, _, ours, ref = rewrite_and_reference(path, ids)
    reference = arch.load_reference(None)
    sparse = [i for i, layer in enumerate(reference.model.layers)
              if type(layer.mlp).__name__.endswith("SparseMoeBlock")]
    assert sparse == [layer.index for layer in arch.args.layers if layer.sparse]
    assert (ours - ref).abs().max().item() < 1e-4, config


@parametrize("onnx", "variant", ["llama3", "llama3-tied", "qwen2", "mistral", "qwen3-tied", "qwen3-moe-mixed",
                                 "smollm3-sliding", "ministral", "qwen3-moe-sliding"], MODEL_TYPE.get)
def test_reference_onnx_matches_eager(tiny_decoder, tmp_path, variant):  # between them, every feature
    arch = open_architecture(Checkpoint.open(tiny_decoder(variant)))
    graph = bind_weights(arch.build_graph(), arch.linear_weight)
    assert_reference_onnx_matches_eager(arch, graph, tmp_path / "ref.onnx")


@pytest.mark.parametrize("variant", ["qwen3", "qwen3-moe-mixed"])
def test_mnn_flavour_has_placeholders_attention_and_moe_ops(tiny_decoder, tmp_path, variant):
    arch = open_architecture(Checkpoint.open(tiny_decoder(variant)))
    path = tmp_path / "llm.onnx"
    nodes = custom_nodes(arch, path)
    in_experts = {spec.name for spec in arch.linears() if ".experts." in spec.name}
    assert {m["name"].decode() for m in nodes["Linear"]} == {spec.name for spec in arch.linears()} - in_experts
    assert [(a["layer_index"], a["kv_shared_layer_index"]) for a in nodes["Attention"]] == [(i, -1) for i in range(4)]
    assert all(a["scale"] == pytest.approx(16 ** -0.5) for a in nodes["Attention"])
    sparse = [layer.index for layer in arch.args.layers if layer.sparse]
    assert sorted((m["layer_id"], m["num_experts"], m["top_k"]) for m in nodes["MoE"]) == [
        (i, arch.args.moe.num_experts, arch.args.moe.top_k) for i in sparse]
    assert len(in_experts) == 3 * len(sparse) * (arch.args.moe.num_experts if sparse else 0)
    assert path.stat().st_size < 200_000  # weights stay outside the graph


def test_roles_and_recipes(tiny_decoder):
    arch = open_architecture(Checkpoint.open(tiny_decoder("qwen3-moe-mixed")))
    specs = {spec.name: spec for spec in arch.linears()}
    plan = recipe("mlp4-attn8", QuantScheme(4, 64))
    # Qwen3-MoE's router stays fp16 like every router (llmexport/quant/recipes.py)
    router = specs["model.layers.1.mlp.gate"]
    assert router.role is LinearRole.ROUTER and plan.scheme_for(router).bits == 16
    assert specs["model.layers.1.mlp.experts.7.down_proj"].role is LinearRole.EXPERT
    assert plan.scheme_for(specs["model.layers.1.mlp.experts.7.down_proj"]).bits == 4
    assert plan.scheme_for(specs["model.layers.0.mlp.up_proj"]).bits == 4
    assert plan.scheme_for(specs["model.layers.0.self_attn.k_proj"]).bits == 8


#: the tiny variants with sliding layers: their layers' slices in the "mix" mask
SLIDING = {"qwen2": [False, False, True, True], "mistral": [True] * 4, "smollm3-sliding": [True, False, True, False],
           "ministral": [True, False, True, False], "qwen3-sliding": [False, True, True, True],
           "qwen3-moe-sliding": [True] * 4}
#: the tiny variants' layers without RoPE (SmolLM3)
NO_ROPE = {"smollm3": [1, 3], "smollm3-sliding": [0, 2]}
STOPS = {"llama": ("<|eot_id|>", "<|eom_id|>"), "mistral": (), "ministral": ()}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_runtime_files_describe_the_family(tiny_decoder, variant):
    arch = open_architecture(Checkpoint.open(tiny_decoder(variant)))
    config = arch.llm_config()
    assert config["layer_nums"] == 4 and "attn_scale" not in config
    if variant in SLIDING:
        assert config["attention_type"] == "mix" and config["sliding_window"] == 6
        assert [layer.sliding for layer in arch.args.layers] == SLIDING[variant]
        assert arch.graph_inputs(5).args[1].shape == (2, 1, 1, 5, 5)
    else:
        assert config["attention_type"] == "full" and "sliding_window" not in config
    assert config["model_type"] == MODEL_TYPE[variant]
    assert [layer.index for layer in arch.args.layers if not layer.rope] == NO_ROPE.get(variant, [])
    assert "<|im_start|>" in config["jinja"]["chat_template"] if FAMILIES[MODEL_TYPE[variant]].tokenizer == "qwen" \
        else "<|start_header_id|>" in config["jinja"]["chat_template"]
    assert arch.runtime_config() == {"precision": arch.precision.value}  # test_runtime_profile: which
    assert arch.end_of_turn_tokens() == STOPS.get(MODEL_TYPE[variant], ("<|im_end|>",))


def test_qwen2_biases_are_q_k_v_only(tiny_decoder):
    arch = open_architecture(Checkpoint.open(tiny_decoder("qwen2-tied")))
    biased = {spec.name.rsplit(".", 1)[-1] for spec in arch.linears() if arch.linear_source(spec.name).bias}
    assert biased == {"q_proj", "k_proj", "v_proj"}
    assert arch.args.sliding_window == 0 and arch.llm_config()["attention_type"] == "full"


def test_transformers_4_config_keys_read_the_same(tiny_decoder, tmp_path):
    """Hub configs spell RoPE as rope_theta + rope_scaling and the expert count num_experts."""
    for variant, legacy in (("llama3", {"rope_theta": 500000.0, "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}}), ("qwen3-moe", {"rope_theta": 1e6, "num_experts": 8})):
        src = tiny_decoder(variant)
        dst = shutil.copytree(src, tmp_path / variant)
        config = json.loads((src / "config.json").read_text())
        config.pop("rope_parameters")
        config.pop("num_local_experts", None)
        (dst / "config.json").write_text(json.dumps({**config, **legacy}))
        assert open_architecture(Checkpoint.open(dst)).args == open_architecture(Checkpoint.open(src)).args


@pytest.mark.parametrize("variant, edit, message", [
    ("qwen3", dict(drop=["model.layers.1.self_attn.q_norm.weight"]), "q_norm.weight' missing"),
    ("qwen3", dict(reshape={"model.layers.0.self_attn.k_norm.weight": (64,)}), r"has shape \[64\]"),
    ("qwen3", dict(add={"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}), "not mapped by the Qwen3"),
    ("qwen3-moe", dict(drop=["model.layers.2.mlp.experts.5.up_proj.weight"]), "experts.5.up_proj.weight' missing"),
    ("llama3", dict(config={"use_sliding_window": True}), "use_sliding_window"),
    ("ministral", dict(config={"layer_types": ["sliding_attention", "chunked_attention"] * 2}), "layer_type"),
    ("qwen3-sliding", dict(config={"sliding_window": 0}), "'sliding_window' must be an integer >= 1"),
    ("qwen3", dict(config={"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                               "original_max_position_embeddings": 4096}}), "rope_type"),
    ("llama3", dict(config={"mlp_bias": True}), "mlp_bias"),
    ("llama3", dict(config={"hidden_act": "gelu"}), "hidden_act"),
    ("llama3", dict(config={"num_key_value_heads": 3}), "multiple of num_key_value_heads"),
    ("llama3", dict(config={"hidden_size": "64"}), "LlamaConfig rejects it"),
    ("llama3", dict(config={"num_attention_heads": 0}), "LlamaConfig rejects it"),
    ("qwen3-moe", dict(config={"num_experts_per_tok": 9}), "exceeds the 8 experts"),
    ("qwen2", dict(config={"layer_types": ["full_attention", "chunked_attention"] * 2}), "layer_type"),
    ("qwen2", dict(config={"layer_types": ["sliding_attention"] * 3}), "layer_type"),
    ("qwen2", dict(config={"sliding_window": 0}), "'sliding_window' must be an integer >= 1"),
    ("mistral", dict(config={"sliding_window": -2}), "'sliding_window' must be an integer >= 1"),
    ("qwen2-tied", dict(add={"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}), "not mapped by the Qwen2"),
    ("qwen2-tied", dict(drop=["model.layers.3.self_attn.v_proj.bias"]), "v_proj.bias' missing"),
    ("smollm3", dict(config={"no_rope_layers": [1, 0, 1]}), "no_rope_layers"),
    ("smollm3", dict(config={"no_rope_layers": [1, 0, 2, 1]}), "no_rope_layers"),
    ("smollm3", dict(config={"mlp_bias": True}), "mlp_bias"),
])
def test_checkpoint_problems_are_input_errors(tiny_decoder, tmp_path, variant, edit, message):
    path = edit_checkpoint(tiny_decoder(variant), tmp_path / "bad", **edit)
    with pytest.raises(InputError, match=message):
        open_architecture(Checkpoint.open(path))


_JUNK = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(allow_nan=True), st.text(max_size=6),
                  st.lists(st.integers(-1, 4), max_size=3),
                  st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
_KEYS = ["num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
         "intermediate_size", "vocab_size", "rms_norm_eps", "rope_parameters", "rope_theta", "rope_scaling",
         "tie_word_embeddings", "attention_bias", "mlp_bias", "hidden_act", "max_position_embeddings", "layer_types",
         "use_sliding_window", "sliding_window", "max_window_layers", "num_experts", "num_local_experts",
         "num_experts_per_tok", "moe_intermediate_size",
         "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "no_rope_layers", "no_rope_layer_interval"]


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 80)), deadline=None,
          derandomize=not os.environ.get("FUZZ_EXAMPLES"), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(variant=st.sampled_from(["llama3", "qwen2", "mistral", "qwen3", "qwen3-moe-mixed", "smollm3-sliding",
                                "ministral", "qwen3-sliding"]),
       key=st.sampled_from(_KEYS), value=_JUNK, delete=st.booleans())
def test_mutated_config_gives_typed_errors(tiny_decoder, tmp_path_factory, variant, key, value, delete):
    """Whatever a config value is, a typed one-line error or a working architecture comes out."""
    assert_config_edit_is_typed(tiny_decoder(variant), tmp_path_factory.mktemp("fuzz"),
                                lambda config: set_or_delete(config, key, value, delete))


def _parse(family_class, config: dict):
    import transformers

    from llmexport.models.decoder.args import parse_decoder_args, resolve_config

    cfg = resolve_config(getattr(transformers, family_class.config_class), config, "config.json")
    return parse_decoder_args(cfg, "config.json", qk_norm=False, rope_types=("default",), sliding=family_class.sliding,
                              biases=family_class.attention_biases, no_rope=family_class.no_rope)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(n=st.integers(1, 8), use=st.booleans(), window=st.integers(1, 64), first=st.integers(0, 10))
def test_qwen2_sliding_layers_follow_max_window_layers(n, use, window, first):
    from llmexport.models.qwen2 import Qwen2

    args = _parse(Qwen2, {**FAMILIES["qwen2"].base, "num_hidden_layers": n, "use_sliding_window": use,
                          "sliding_window": window, "max_window_layers": first})
    assert [layer.sliding for layer in args.layers] == [use and i >= first for i in range(n)]
    assert args.sliding_window == (window if use and first < n else 0)
    assert args.biases == {"attn.q", "attn.k", "attn.v"}


@settings(max_examples=40, deadline=None, derandomize=True)
@given(n=st.integers(1, 8), window=st.one_of(st.none(), st.integers(1, 64)))
def test_mistral_slides_every_layer_with_a_window(n, window):
    from llmexport.models.mistral import Mistral

    args = _parse(Mistral, {**FAMILIES["mistral"].base, "num_hidden_layers": n, "sliding_window": window})
    assert [layer.sliding for layer in args.layers] == [window is not None] * n
    assert args.sliding_window == (window or 0) and args.biases == frozenset()


@settings(max_examples=40, deadline=None, derandomize=True)
@given(n=st.integers(1, 8), interval=st.integers(1, 5), use=st.booleans(), window=st.integers(1, 64))
def test_smollm3_nope_layers_follow_the_interval(n, interval, use, window):
    from llmexport.models.smollm3 import SmolLM3

    args = _parse(SmolLM3, {**FAMILIES["smollm3"].base, "num_hidden_layers": n, "no_rope_layer_interval": interval,
                            "use_sliding_window": use, "sliding_window": window})
    rope = [(i + 1) % interval != 0 for i in range(n)]
    assert [layer.rope for layer in args.layers] == rope
    assert [layer.sliding for layer in args.layers] == [use and not r for r in rope]
