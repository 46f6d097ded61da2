"""The K2-Horizon reference (llmexport/reference/k2_horizon) against the published facts, and the
tiny checkpoints against the schema of docs/k2-horizon.md."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from llmexport.reference.k2_horizon import GroupedRMSNorm, K2HorizonConfig, K2HorizonForCausalLM, K2HorizonRouter
from llmexport.tiny.k2_horizon import variant_config


def _rms(x, weight, eps):
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight


def test_grouped_rms_norm_with_one_group_is_rms_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    x = torch.randn(3, 5, 64) * 3
    ours, llama = GroupedRMSNorm(64, groups=1, eps=1e-6), LlamaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        llama.weight.copy_(ours.weight)
        assert torch.allclose(ours(x), llama(x), atol=1e-6)
        assert torch.allclose(ours(x), _rms(x, ours.weight, 1e-6), atol=1e-6)


def test_grouped_rms_norm_normalises_halves_independently():
    torch.manual_seed(0)
    norm = GroupedRMSNorm(64, groups=2, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        x = torch.randn(4, 64)
        out = norm(x)
        w = norm.weight
        assert torch.allclose(out[:, :32], _rms(x[:, :32], w[:32], 1e-6), atol=1e-6)
        assert torch.allclose(out[:, 32:], _rms(x[:, 32:], w[32:], 1e-6), atol=1e-6)
        # scaling one half leaves both halves' outputs unchanged (each is scale-invariant alone) ...
        scaled = x.clone()
        scaled[:, 32:] *= 10
        assert torch.allclose(norm(scaled), out, atol=1e-5)
        # ... which full-width RMSNorm is not
        assert not torch.allclose(_rms(scaled, w, 1e-6), _rms(x, w, 1e-6), atol=1e-3)
        # fp32 inside, input dtype out
        assert norm(x.bfloat16()).dtype == torch.bfloat16


def _router(scoring="sigmoid", normalize=True, scale=2.5, experts=8, k=2):
    torch.manual_seed(0)
    router = K2HorizonRouter(16, experts, k, scoring, normalize, scale)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
    return router


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
@pytest.mark.parametrize("normalize", [True, False])
def test_router_bias_chooses_but_never_weighs(scoring, normalize):
    router = _router(scoring, normalize)
    x = torch.randn(64, 16)
    with torch.no_grad():
        scores = router.scores(x)
        _, c0 = router(x)
        router.e_score_correction_bias.copy_(torch.tensor([0, 0, 0, 0, 0, 0, 5.0, 5.0]))
        w1, c1 = router(x)
    assert (c0.sort().values != c1.sort().values).any(dim=-1).float().mean() > 0.5  # choice changed
    assert set(c1.view(-1).tolist()) == {6, 7}  # the bias decided the choice...
    expected = scores.gather(-1, c1)  # ...but the weights are the unbiased scores
    if normalize:
        expected = expected / expected.sum(-1, keepdim=True)
    assert torch.allclose(w1, expected * 2.5, atol=1e-6)
    assert w1.dtype == torch.float32


def test_router_scores_are_fp32_and_sigmoid_or_softmax():
    x = torch.randn(5, 16)
    sig, soft = _router("sigmoid"), _router("softmax")
    logits = x @ sig.weight.T
    assert torch.allclose(sig.scores(x), torch.sigmoid(logits), atol=1e-6)
    assert torch.allclose(soft.scores(x), torch.softmax(logits, -1), atol=1e-6)
    assert sig.scores(x.bfloat16()).dtype == torch.float32


def _sparse_config(**overrides):
    cfg = dict(variant_config("sparse"), **overrides)
    return K2HorizonConfig(**cfg)


def test_mova_values_are_the_silu_weighted_sum_of_the_chosen_experts():
    torch.manual_seed(0)
    model = K2HorizonForCausalLM(_sparse_config(mova_num_experts=8, mova_top_k=3)).eval()
    attn = model.model.layers[1].self_attn
    assert attn.mova and not hasattr(attn, "v_proj")
    with torch.no_grad():
        attn.v_router.e_score_correction_bias.uniform_(-0.3, 0.3)
    calls = [0] * 8
    for e, expert in enumerate(attn.v_experts):
        expert.register_forward_hook(lambda m, i, o, e=e: calls.__setitem__(e, calls[e] + i[0].shape[0]))
    x = torch.randn(1, 6, 64)
    with torch.no_grad():
        values = attn.mova_values(x)
        ran = list(calls)
        weights, chosen = attn.v_router(x.view(-1, 64))
        expected = torch.zeros(6, 32)
        for t in range(6):
            for k in range(3):
                expert = attn.v_experts[int(chosen[t, k])]
                expected[t] += weights[t, k] * F.silu(expert(x[0, t]))
    assert values.shape == (1, 6, 32)
    assert torch.allclose(values[0], expected, atol=1e-6)
    # only the chosen experts ran, each on exactly the tokens that chose it
    assert ran == [int((chosen == e).sum()) for e in range(8)] and sum(ran) == 18


def test_sparse_layer_rule():
    cfg = _sparse_config(num_hidden_layers=6, mlp_only_layers=[1], decoder_sparse_step=2)
    assert [cfg.is_sparse_layer(i) for i in range(6)] == [False, False, False, True, False, True]
    assert [cfg.uses_mova(i) for i in range(6)] == [False, False, False, True, False, True]
    step1 = _sparse_config(num_hidden_layers=4, mlp_only_layers=[2], decoder_sparse_step=1)
    assert [step1.is_sparse_layer(i) for i in range(4)] == [True, True, False, True]
    no_experts = _sparse_config(num_hidden_layers=4, num_experts=0)
    assert not any(no_experts.is_sparse_layer(i) for i in range(4))
    no_mova = _sparse_config(num_hidden_layers=4, mova_num_experts=0, mova_top_k=0)
    assert [no_mova.uses_mova(i) for i in range(4)] == [False, False, False, False]
    model = K2HorizonForCausalLM(no_mova)
    layer = model.model.layers[1]
    assert type(layer.mlp).__name__ == "K2HorizonSparseMoeBlock" and hasattr(layer.self_attn, "v_proj")
    assert type(model.model.layers[0].mlp).__name__ == "K2HorizonMLP"


def test_mova_router_settings_default_to_the_moe_router():
    cfg = _sparse_config(norm_topk_prob=False, router_scaling_factor=2.0)
    assert (cfg.mova_norm_topk, cfg.mova_scaling) == (False, 2.0)
    cfg = _sparse_config(mova_norm_topk_prob=True, mova_router_scaling_factor=1.5)
    assert (cfg.mova_norm_topk, cfg.mova_scaling) == (True, 1.5)


def test_checkpoint_carries_remote_code_and_the_schema(tiny_k2_horizon):
    from transformers import AutoModelForCausalLM

    from llmexport.reference.k2_horizon import REMOTE_CODE_FILES

    path = tiny_k2_horizon("sparse-qknorm")
    for source in REMOTE_CODE_FILES:  # the package's reference is what the checkpoint ships
        assert (path / source.name).read_bytes() == source.read_bytes()
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "k2_horizon"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_k2_horizon.K2HorizonForCausalLM"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias").dtype == torch.float32
        assert f.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.bfloat16
    p = "model.layers.1."
    assert {p + "self_attn.v_router.weight", p + "self_attn.v_router.e_score_correction_bias",
            p + "self_attn.v_experts.7.weight", p + "self_attn.q_norm.weight", p + "mlp.gate.weight",
            p + "mlp.experts.7.down_proj.weight", p + "mlp.shared_experts.up_proj.weight",
            "model.layers.0.self_attn.v_proj.weight", "model.layers.0.mlp.gate_proj.weight"} <= names
    assert p + "self_attn.v_proj.weight" not in names and "lm_head.weight" not in names  # MoVA layer; tied
    assert not any("inv_freq" in n for n in names)
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)
    assert type(model).__module__.startswith("transformers_modules.")  # the checkpoint's copy
    assert model.model.rotary_emb.inv_freq[0] == 1.0  # recomputed, not left uninitialised


def test_biased_choice_differs_from_unbiased_in_tiny_checkpoints(tiny_k2_horizon):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_k2_horizon("sparse"), trust_remote_code=True,
                                                 dtype=torch.float32)
    x = model.model.layers[1].input_layernorm(model.model.embed_tokens(torch.arange(20, 84)))
    for router in (model.model.layers[1].self_attn.v_router, model.model.layers[1].mlp.gate):
        with torch.no_grad():
            scores = router.scores(x)
            _, biased = router(x)
        unbiased = scores.topk(router.top_k, dim=-1).indices
        differs = (biased.sort().values != unbiased.sort().values).any(-1).float().mean()
        assert differs > 0.2, differs


def test_cached_generation_equals_full_recomputation(tiny_k2_horizon):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_k2_horizon("sparse"), trust_remote_code=True,
                                                 dtype=torch.float32)
    ids = torch.arange(40, 60).view(1, -1)
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=8, do_sample=False)[0, 20:].tolist()
        seq = ids[0].tolist()
        for _ in range(8):
            seq.append(int(model(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    assert generated == seq[20:]
