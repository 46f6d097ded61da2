"""--lora_path: a PEFT LoRA adapter merged into the weights as they stream (llmexport/source/lora/).

The adapters are trained nowhere: PEFT itself builds them on the tiny checkpoints' HF models with
random factors (``init_lora_weights=False``) and saves them as it saves any adapter, and PEFT's
own ``merge_and_unload`` is the independent reference of the merge.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import peft
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from llmexport.api import export
from llmexport.errors import InputError
from llmexport.options import ExportOptions
from llmexport.quant.scheme import QuantScheme
from llmexport.reference.streamed import mapped_blocks, streamed_reference
from llmexport.source.checkpoint import Checkpoint, CheckpointTensors
from llmexport.source.loading import open_architecture
from llmexport.source.lora import LoraConfig, merged
from llmexport.tiny.decoders import build_tiny_decoder
from llmexport.tiny.gemma4_towers import build_tiny_multimodal
from llmexport.tiny.phi3 import build_tiny_phi3
from llmexport.verification.verify import stored_tensors, summary_line, verify_export


def _adapter(path: Path, out: Path, seed: int = 0, trust_remote_code: bool = False,
             **config) -> dict[str, torch.Tensor]:
    """A PEFT adapter with random factors on the HF model of ``path`` (fp32), saved to ``out``;
    returns PEFT's merged state dict."""
    model = open_architecture(Checkpoint.open(path)).load_reference(None, trust_remote_code)
    torch.manual_seed(seed)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **config))
    with torch.no_grad():  # PEFT's random init leaves B small: make the delta matter
        for name, param in wrapped.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                param.normal_(0, 0.2)
            elif "modules_to_save" in name or (param.requires_grad and name.endswith("bias")):
                param.add_(torch.randn_like(param) * 0.05)  # a copy of the base's until trained
    wrapped.save_pretrained(out)
    return {k: v.clone() for k, v in wrapped.merge_and_unload().state_dict().items()}


def _checked(path: Path, adapter: Path, reference: dict[str, torch.Tensor], tol: float = 2e-6) -> set[str]:
    """Every tensor the adapter changes equals PEFT's merge; returns their names."""
    arch = open_architecture(Checkpoint.open(path), adapter)
    base = Checkpoint.open(path).weights
    changed = arch.checkpoint.weights.adapter.targets()
    for name in changed:
        ours = arch.checkpoint.weights.tensor(name).float()
        assert not torch.equal(ours, base.tensor(name).float()), name
        assert (ours - reference[name]).abs().max() <= tol * (1 + reference[name].abs().max()), name
    return changed


# --- the merge math -----------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(out=st.integers(1, 24), inp=st.integers(1, 24), r=st.integers(1, 8), alpha=st.floats(0.5, 64),
       seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_merge_is_w_plus_scaled_b_at_a(out, inp, r, alpha, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    w, a, b = (torch.randn(s, generator=g) for s in ((out, inp), (r, inp), (out, r)))
    w = w.to(dtype)
    scale = alpha / r
    expected = torch.tensor([[float(w[i, j]) + scale * math.fsum(float(b[i, k]) * float(a[k, j]) for k in range(r))
                              for j in range(inp)] for i in range(out)], dtype=torch.float64).to(dtype)
    result = merged(w, b, a, scale)
    assert result.dtype == dtype and torch.equal(result, expected)
    rows = merged(w[1:], b[1:], a, scale)  # a row range rounds like the same rows of the whole
    assert torch.equal(rows, result[1:])


def test_scale_follows_rslora_and_patterns(tmp_path):
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "use_rslora": True,
              "rank_pattern": {"q_proj": 4}, "alpha_pattern": {"layers\\.1\\.mlp\\.down_proj": 2}}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    lora = LoraConfig.read(tmp_path)
    assert lora.rank_alpha("model.layers.0.self_attn.q_proj") == (4, 16.0)
    assert lora.rank_alpha("model.layers.1.mlp.down_proj") == (8, 2.0)
    assert lora.rank_alpha("model.layers.1.mlp.up_proj") == (8, 16.0)
    assert lora.scale("model.layers.0.self_attn.q_proj") == 16 / 2
    assert lora.scale("model.layers.0.mlp.up_proj") == pytest.approx(16 / math.sqrt(8))


# --- name mapping, against PEFT's merge ---------------------------------------------------------
@pytest.mark.parametrize("variant", ["llama3", "qwen3"])
def test_decoder_merge_matches_peft(tmp_path, variant):
    path = build_tiny_decoder(tmp_path / "m", variant, dtype=torch.float32)
    reference = _adapter(path, tmp_path / "a", r=4, lora_alpha=8, rank_pattern={"down_proj": 2},
                         alpha_pattern={"o_proj": 3}, use_rslora=True,
                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                         modules_to_save=["lm_head"])
    changed = _checked(path, tmp_path / "a", reference)
    assert "model.layers.1.mlp.down_proj.weight" in changed and "lm_head.weight" in changed


def test_trained_biases_replace_the_checkpoints(tmp_path):
    path = build_tiny_decoder(tmp_path / "m", "qwen2", dtype=torch.float32)  # q/k/v biases
    reference = _adapter(path, tmp_path / "a", r=2, lora_alpha=2, target_modules=["q_proj", "k_proj"],
                         bias="lora_only")
    changed = _checked(path, tmp_path / "a", reference)
    assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.weight"} <= changed
    assert "model.layers.0.self_attn.v_proj.bias" not in changed


def test_flag_and_manifest_fields(tmp_path):
    from llmexport.cli import export_options, parse_command

    base = ["--path", "x", "--dst_path", "y"]
    assert export_options(parse_command([*base, "--lora_path", "/adapters/a"])).lora == Path("/adapters/a")
    assert "lora" not in ExportOptions().manifest_fields()  # manifests without an adapter stay as they were
    assert ExportOptions(lora=Path("/adapters/a")).manifest_fields()["lora"] == "/adapters/a"


def test_phi3_fused_qkv_merges_into_the_fused_weight(tmp_path):
    path = build_tiny_phi3(tmp_path / "m", dtype=torch.float32)
    reference = _adapter(path, tmp_path / "a", r=3, lora_alpha=5, target_modules=["qkv_proj", "gate_up_proj"])
    changed = _checked(path, tmp_path / "a", reference)
    assert "model.layers.0.self_attn.qkv_proj.weight" in changed
    arch = open_architecture(Checkpoint.open(path), tmp_path / "a")
    weight, _ = arch.linear_weight("model.layers.0.self_attn.qkv_proj")  # what the export quantizes
    assert (weight - reference["model.layers.0.self_attn.qkv_proj.weight"]).abs().max() < 1e-5


def test_gemma4_text_and_vision_tower(tiny_gemma4, tmp_path):
    path = build_tiny_multimodal(tmp_path / "m", "vision-64")
    reference = _adapter(path, tmp_path / "a", r=2, lora_alpha=4,
                         target_modules=r".*language_model.*\.(q_proj|down_proj)|.*vision_tower.*\.o_proj\.linear")
    changed = _checked(path, tmp_path / "a", reference)
    assert {n.split(".")[1] for n in changed} == {"language_model", "vision_tower"}
    text = _adapter(tiny_gemma4("e2b", text_only=True), tmp_path / "t", r=2, lora_alpha=4,
                    target_modules=["v_proj"])
    assert any(n.startswith("model.layers.") for n in _checked(tiny_gemma4("e2b", text_only=True),
                                                                tmp_path / "t", text))


def test_k2_horizon_attention_and_routed_experts(tiny_k2_horizon, tmp_path):
    """The remote-code family: its routed experts are per-expert nn.Linear modules (not stacked)."""
    path = tiny_k2_horizon("sparse")
    reference = _adapter(path, tmp_path / "a", trust_remote_code=True, r=2, lora_alpha=4,
                         target_modules=["q_proj", "down_proj"])
    changed = _checked(path, tmp_path / "a", reference, tol=2 ** -8)  # a bf16 checkpoint: ours rounded to bf16
    assert any(".experts." in n for n in changed) and any("self_attn.q_proj" in n for n in changed)


def test_gemma3_text(tiny_gemma3, tmp_path):
    path = tiny_gemma3("1b")
    reference = _adapter(path, tmp_path / "a", r=2, lora_alpha=4, target_modules=["k_proj", "gate_proj"])
    assert len(_checked(path, tmp_path / "a", reference, tol=2 ** -8)) > 2  # bf16: ours rounded to bf16


def test_lfm2_conv_attention_and_mlp(tiny_lfm2, tmp_path):
    """LFM2's short-conv projections, attention and feed_forward (PEFT targets by module name)."""
    path = tiny_lfm2("dense")
    reference = _adapter(path, tmp_path / "a", r=2, lora_alpha=4, target_modules=["in_proj", "q_proj", "w2"])
    changed = _checked(path, tmp_path / "a", reference, tol=2 ** -8)  # a bf16 checkpoint: ours rounded to bf16
    assert {n.split(".")[-2] for n in changed} == {"in_proj", "q_proj", "w2"}


def test_embedding_lora_merges_as_the_table_streams(tmp_path, monkeypatch):
    path = build_tiny_decoder(tmp_path / "m", "llama3", dtype=torch.float32)
    reference = _adapter(path, tmp_path / "a", r=4, lora_alpha=4, target_modules=["embed_tokens"])
    monkeypatch.setattr("llmexport.source.lora.merge.BLOCK_VALUES", 1000)
    arch = open_architecture(Checkpoint.open(path), tmp_path / "a")
    table = arch.embedding_table()
    full = reference["model.embed_tokens.weight"]
    assert (torch.cat(list(table.row_chunks(max_bytes=1000))).float() - full).abs().max() < 1e-5
    ids = torch.tensor([7, 3, 3, 250])
    assert torch.equal(table.take(ids), table.read()[ids])


@pytest.mark.parametrize("block", [1 << 22, 100])  # one block, and 100-value blocks (a big lm_head's case)
def test_bf16_checkpoint_rounds_once(tmp_path, monkeypatch, block):
    monkeypatch.setattr("llmexport.source.lora.merge.BLOCK_VALUES", block)
    path = build_tiny_decoder(tmp_path / "m", "llama3")  # bf16
    _adapter(path, tmp_path / "a", r=4, lora_alpha=8, target_modules=["up_proj"])
    arch = open_architecture(Checkpoint.open(path), tmp_path / "a")
    name = "model.layers.0.mlp.up_proj.weight"
    ours = arch.checkpoint.weights.tensor(name)
    factors = load_file(tmp_path / "a" / "adapter_model.safetensors")
    a, b = (factors[f"base_model.model.model.layers.0.mlp.up_proj.lora_{s}.weight"] for s in "AB")
    base = Checkpoint.open(path).weights.tensor(name)
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours, (base.double() + 2.0 * (b.double() @ a.double())).to(torch.bfloat16))


# --- the reference --verify runs ----------------------------------------------------------------
def test_verify_reference_carries_the_merge(tmp_path):
    path = build_tiny_decoder(tmp_path / "m", "qwen3", dtype=torch.float32)
    model = open_architecture(Checkpoint.open(path)).load_reference(None)
    torch.manual_seed(1)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                         target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
    wrapped.save_pretrained(tmp_path / "a")
    hf = wrapped.merge_and_unload()
    arch = open_architecture(Checkpoint.open(path), tmp_path / "a")
    base = open_architecture(Checkpoint.open(path))
    ids = torch.arange(3, 40)
    with mapped_blocks(), torch.no_grad():
        ours = arch.reference_logits(streamed_reference(arch, CheckpointTensors(arch.checkpoint.weights)), ids)
        unmerged = base.reference_logits(streamed_reference(base, CheckpointTensors(base.checkpoint.weights)), ids)
        expected = arch.reference_logits(hf, ids)
    assert (ours - expected).abs().max() < 1e-4
    assert (unmerged - expected).abs().max() > 100 * (ours - expected).abs().max()


# --- bad adapters: one line naming the key ------------------------------------------------------
@pytest.fixture(scope="module")
def llama_with_adapter(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-bad")
    path = build_tiny_decoder(root / "m", "llama3", dtype=torch.float32)
    _adapter(path, root / "a", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return path, root / "a"


def _broken(source: Path, out: Path, config: dict | None = None, tensors=None) -> Path:
    out.mkdir()
    raw = json.loads((source / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**raw, **(config or {})}))
    factors = load_file(source / "adapter_model.safetensors")
    save_file({k: v.clone() for k, v in (tensors(factors) if tensors else factors).items()},
              out / "adapter_model.safetensors")
    return out


CLI = (sys.executable, "-c", "from llmexport.cli import main; main()")
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize("config, tensors, message", [
    ({"use_dora": True}, None, "use_dora = True is not supported"),
    ({"peft_type": "LOHA"}, None, "peft_type 'LOHA' is not supported"),
    ({"fan_in_fan_out": True}, None, "fan_in_fan_out = True is not supported"),
    ({"bias": "some"}, None, "bias = 'some'"),
    ({"r": 8}, None, f"{Q_A!r}: factors [4, 64] and"),
    (None, lambda f: {**f, Q_A.replace("q_proj", "qq_proj"): f[Q_A]},
     f"{Q_A.replace('q_proj', 'qq_proj')!r}: the checkpoint has no tensor 'model.layers.0.self_attn.qq_proj.weight'"),
    (None, lambda f: {k: v for k, v in f.items() if "q_proj.lora_B" not in k or ".0." not in k},
     f"{Q_A!r} has no B factor"),
    (None, lambda f: {**f, Q_A: f[Q_A][:, :-1].contiguous()}, f"{Q_A!r}: factors [4, 63]"),
    (None, lambda f: {**f, Q_A.replace("lora_A.weight", "lora_magnitude_vector"): torch.ones(64)},
     "is a LoRA tensor this merge does not know"),
    (None, lambda f: {**f, "base_model.model.model.norm.weight": torch.ones(64)},
     "'base_model.model.model.norm.weight': the export does not read 'model.norm.weight'"),
    (None, lambda f: {**f, "base_model.model.lm_head.weight": torch.ones(3, 3)},
     "'base_model.model.lm_head.weight' is [3, 3], the checkpoint's 'lm_head.weight'"),
    (None, lambda f: {"q_proj.lora_A.weight": f[Q_A]}, "'q_proj.lora_A.weight' is not a PEFT adapter tensor"),
])
def test_bad_adapter_is_refused_naming_the_key(llama_with_adapter, tmp_path, config, tensors, message):
    path, good = llama_with_adapter
    with pytest.raises(InputError) as info:
        open_architecture(Checkpoint.open(path), _broken(good, tmp_path / "bad", config, tensors))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_cli_refuses_a_bad_adapter_and_writes_nothing(llama_with_adapter, tmp_path):
    path, good = llama_with_adapter
    bad = _broken(good, tmp_path / "bad", {"use_dora": True})
    dst = tmp_path / "out"
    proc = subprocess.run([*CLI, "--path", str(path), "--dst_path", str(dst),
                           "--lora_path", str(bad)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == InputError.exit_code
    assert proc.stderr.strip().splitlines() == [
        f"llmexport: error: {bad / 'adapter_config.json'}: use_dora = True is not supported (only False: a plain "
        "LoRA merges as W + scale * B @ A)"]
    assert not dst.exists()


def test_tied_head_target_is_refused(tmp_path):
    path = build_tiny_decoder(tmp_path / "m", "llama3-tied", dtype=torch.float32)
    _adapter(path, tmp_path / "a", r=2, lora_alpha=2, target_modules=["q_proj"])
    bad = _broken(tmp_path / "a", tmp_path / "bad", tensors=lambda f: {
        **f, "base_model.model.lm_head.lora_A.weight": torch.ones(2, 64),
        "base_model.model.lm_head.lora_B.weight": torch.ones(256, 2)})
    with pytest.raises(InputError, match="the checkpoint has no tensor 'lm_head.weight'"):
        open_architecture(Checkpoint.open(path), bad)


# --- end to end ---------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("variant, bits", [("llama3", 16), ("qwen3", 4), ("phi4-mini", 8)])
def test_adapter_merged_export_passes_verify(tmp_path, variant, bits):
    path = (build_tiny_phi3 if variant.startswith("phi") else build_tiny_decoder)(tmp_path / "m", variant)
    _adapter(path, tmp_path / "a", r=8, lora_alpha=16, target_modules="all-linear")
    out = tmp_path / "out"
    export(path, out, ExportOptions(quant=QuantScheme(bits, 64), lora=tmp_path / "a"))
    report = verify_export(out, path, steps=24, lora=tmp_path / "a")
    print(f"\n{variant} q{bits} + LoRA: {summary_line(report)}")
    assert report.passed, report.failures
    # against HF without the adapter the same export is far off (4 bits: the rounding noise of a tiny
    # model is large, yet the adapter's change is larger)
    unmerged = verify_export(out, path, steps=24)
    assert unmerged.fp32.mean_abs_err > (100 if bits == 16 else 2) * report.fp32.mean_abs_err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["options"]["lora"] == str(tmp_path / "a")
    assert manifest["lora"]["r"] == 8 and manifest["lora"]["lora_alpha"] == 16
    assert set(manifest["lora"]["sha256"]) == {"adapter_config.json", "adapter_model.safetensors"}


@pytest.mark.slow
def test_cli_lora_verify(tmp_path):
    path = build_tiny_decoder(tmp_path / "m", "qwen3")
    _adapter(path, tmp_path / "a", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"])
    proc = subprocess.run([*CLI, "--path", str(path), "--dst_path", str(tmp_path / "o"),
                           "--quant_bit", "8", "--lora_path", str(tmp_path / "a"), "--verify"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "o" / "verify.json").read_text())["passed"]


@pytest.mark.slow
def test_gemma4_vision_adapter_export_passes_verify(tmp_path):
    """An adapter on Gemma4's decoder and on its vision tower's linears: both merged, both verified
    (the tower's check compares visual.mnn with HF's tower carrying the merge)."""
    path = build_tiny_multimodal(tmp_path / "m", "vision-64")
    _adapter(path, tmp_path / "a", r=4, lora_alpha=8,
             target_modules=r".*language_model.*\.(q_proj|o_proj|up_proj)|.*vision_tower.*\.(q_proj|o_proj)\.linear")
    out = tmp_path / "out"
    export(path, out, ExportOptions(quant=QuantScheme(16, 64), visual_quant_bit=16, lora=tmp_path / "a"))
    report = verify_export(out, path, steps=16, lora=tmp_path / "a")
    print(f"\ngemma4 vision-64 q16 + LoRA: {summary_line(report)}")
    assert report.passed, report.failures
    unmerged = verify_export(out, path, steps=16)  # the text against HF without the adapter: far off
    assert unmerged.fp32.mean_abs_err > 10 * report.fp32.mean_abs_err
    # the tower's check runs on the stored weights: visual.mnn holds the merged ones
    arch = open_architecture(Checkpoint.open(path), tmp_path / "a")
    name = "model.vision_tower.encoder.layers.0.self_attn.o_proj.linear.weight"
    stored = stored_tensors(out, arch).read(name)
    merged_weight, base = arch.checkpoint.weights.tensor(name).float(), Checkpoint.open(path).weights.tensor(name)
    assert (stored - merged_weight).abs().max() < 1e-3 * merged_weight.abs().max()
    assert (stored - base.float()).abs().max() > 10 * (stored - merged_weight).abs().max()
