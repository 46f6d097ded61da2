"""Activation-aware scaling (``--calib_method awq|smooth[+gptq]``): the scales (llmexport/quant/scales.py),
the exact fold into the model (llmexport/calibration/folding.py) and the export that stores it
(llmexport/calibration/activation_scaling.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmexport.api import export
from llmexport.calibration.activation_scaling import scale_and_fold
from llmexport.calibration.folding import (
    FoldedWeights,
    fold,
    fold_refusal,
    folded_architecture,
    folded_norm,
    tensor_readers,
)
from llmexport.cli import main
from llmexport.mnn.config import FOLDED_NORMS
from llmexport.options import CalibMethod, Calibration, ExportOptions
from llmexport.planning.schemes import Schemes
from llmexport.quant.methods import quantizers
from llmexport.quant.rtn import quantize_rtn
from llmexport.quant.scales import Rounded, awq_scales, group_loss, smooth_scales
from llmexport.quant.scheme import QuantMethod, QuantScheme
from llmexport.reference.streamed import mapped_blocks, streamed_reference
from llmexport.source.checkpoint import Checkpoint, CheckpointTensors
from llmexport.source.loading import open_architecture
from llmexport.spec import NormFormula
from llmexport.tiny.byte_level_tokenizer import EXTRA_CORPUS
from llmexport.tiny.tokenizer import TRAINING_CORPUS
from llmexport.verification.verify import stored_tensors, verify_export

# --- the scales -------------------------------------------------------------------------------------

def _outlier_inputs(ic: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1024, ic, generator=g)
    x[:, :4] *= 30.0  # a few salient channels, as LLM activations have
    return x


def test_awq_lowers_the_output_error_of_salient_channels():
    g = torch.Generator().manual_seed(0)
    weights = [Rounded(torch.randn(48, 128, generator=g) * 0.02, 4, 32, False) for _ in range(2)]
    x = _outlier_inputs(128, 1)
    h = x.T.double() @ x.double()
    choice = awq_scales(weights, h, x.abs().mean(0), quantize_rtn)
    assert choice.alpha > 0 and choice.loss < 0.8 * choice.base_loss
    assert choice.loss == pytest.approx(group_loss(weights, h, choice.scales, quantize_rtn))
    assert choice.base_loss == pytest.approx(group_loss(weights, h, torch.ones(128), quantize_rtn))


def test_awq_never_picks_scales_worse_than_none():
    """Uniform inputs: nothing to protect; alpha 0 (no scaling) is on the grid and wins ties."""
    w = [Rounded(torch.randn(16, 64, generator=torch.Generator().manual_seed(2)), 4, 32, True)]
    h = torch.eye(64, dtype=torch.float64)
    choice = awq_scales(w, h, torch.ones(64), quantize_rtn)
    assert choice.loss <= choice.base_loss and torch.equal(choice.scales, torch.ones(64))


def test_smooth_scales_move_outliers_into_the_weights():
    x, w = _outlier_inputs(64, 3), torch.randn(32, 64) * 0.02
    s = smooth_scales(x.abs().amax(0), w.abs().amax(0), 0.5)
    smoothed_x, smoothed_w = x / s, w * s
    assert smoothed_x.abs().amax(0).max() / smoothed_x.abs().amax(0).min() < \
        x.abs().amax(0).max() / x.abs().amax(0).min() / 4
    assert torch.allclose(smoothed_x @ smoothed_w.T, x @ w.T, rtol=1e-4, atol=1e-4)


@given(formula=st.sampled_from(list(NormFormula)), seed=st.integers(0, 1000))
@settings(max_examples=30, deadline=None)
def test_a_folded_norm_divides_its_output(formula, seed):
    g = torch.Generator().manual_seed(seed)
    w, s = torch.randn(16, generator=g), torch.rand(16, generator=g) * 4 + 0.1
    gain = (lambda v: v if formula is NormFormula.SCALE else 1 + v)  # noqa: E731
    assert torch.allclose(gain(folded_norm(w, s, formula)), gain(w) / s, rtol=1e-5, atol=1e-6)


# --- the fold is exact ------------------------------------------------------------------------------

FAMILIES = [("decoder", "llama3"), ("decoder", "llama3-tied"), ("decoder", "qwen2"), ("decoder", "qwen3"),
            ("decoder", "qwen3-moe-mixed"), ("gemma3", "scaled"), ("gemma4", "e2b"), ("lfm2", "dense"),
            ("lfm2", "moe"), ("qwen3_5", "qwen3_5-text"), ("qwen3_5", "qwen3_5-moe")]


@pytest.fixture
def family_checkpoint(request, tiny_decoder, tiny_gemma3, tiny_gemma4, tiny_lfm2, tiny_qwen3_5):
    kind, variant = request.param
    return {"decoder": tiny_decoder, "gemma3": tiny_gemma3, "lfm2": tiny_lfm2, "qwen3_5": tiny_qwen3_5}[kind](variant) \
        if kind != "gemma4" else tiny_gemma4(variant, text_only=True)


def _random_folds(arch, seed: int) -> tuple[FoldedWeights, int]:
    """Every foldable group of ``arch`` folded with random scales (0.2 to 5)."""
    g = torch.Generator().manual_seed(seed)
    weights, readers, norms = FoldedWeights(arch.checkpoint.weights), tensor_readers(arch), set()
    specs = {s.name: s for s in arch.linears()}
    folded = 0
    for group in arch.scale_groups():
        if fold_refusal(arch, group, readers, norms) is not None:
            continue
        width = specs[group.producer].out_features if group.producer else specs[group.linears[0]].in_features
        fold(arch, weights, group, torch.exp(torch.rand(width, generator=g) * 3.2 - 1.6))
        norms.add(group.norm)
        folded += 1
    return weights, folded


@pytest.mark.parametrize("family_checkpoint", FAMILIES, indirect=True, ids=[v for _, v in FAMILIES])
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000))
def test_the_folded_model_computes_the_same_logits(family_checkpoint, seed):
    arch = open_architecture(Checkpoint.open(family_checkpoint))
    weights, folded = _random_folds(arch, seed)
    assert folded >= arch.describe().layers  # at least the attention norm of every layer
    ids = torch.randint(3, 200, (24,), generator=torch.Generator().manual_seed(seed))
    with mapped_blocks():
        plain = arch.reference_logits(streamed_reference(arch, CheckpointTensors(arch.checkpoint.weights)), ids)
        again = folded_architecture(arch, weights)
        scaled = again.reference_logits(streamed_reference(again, CheckpointTensors(again.checkpoint.weights)), ids)
    assert torch.allclose(scaled, plain, rtol=1e-4, atol=1e-4 * float(plain.abs().max())), \
        float((scaled - plain).abs().max())
    # the folded family's own views agree: the linears it streams, the constants its graph holds
    name = arch.scale_groups()[0].linears[0]
    assert not torch.equal(again.linear_weight(name)[0], arch.linear_weight(name)[0].float())


def test_folds_that_are_not_exact_are_refused(tiny_decoder, tiny_gemma4):
    moe = open_architecture(Checkpoint.open(tiny_decoder("qwen3-moe-mixed")))
    readers = tensor_readers(moe)
    reasons = {fold_refusal(moe, g, readers, set()) for g in moe.scale_groups()}
    assert any(r and "routed experts" in r for r in reasons)
    gemma = open_architecture(Checkpoint.open(tiny_gemma4("e2b", text_only=True)))
    readers = tensor_readers(gemma)
    reasons = {fold_refusal(gemma, g, readers, set()) for g in gemma.scale_groups()}
    assert any(r and "v_norm" in r for r in reasons)
    first = next(g for g in gemma.scale_groups() if g.norm)
    assert "feeds another group" in str(fold_refusal(gemma, first, readers, {first.norm}))


# --- the export -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def calibration_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "text.txt"
    path.write_text((TRAINING_CORPUS + EXTRA_CORPUS) * 3, encoding="utf-8")
    return path


@pytest.mark.parametrize("method", ["awq", "smooth"])
def test_scaling_folds_every_exact_group(tiny_decoder, calibration_text, method):
    arch = open_architecture(Checkpoint.open(tiny_decoder("llama3")))
    options = ExportOptions(quant=QuantScheme(4, 32))
    result = scale_and_fold(arch, Calibration(calibration_text, 2, 32, CalibMethod(method)),
                            Schemes(arch, options).linear, quantizers(False))
    assert len(result.folded) == 4 * arch.describe().layers, result.skipped
    assert all(ratio <= 1.0 for ratio in result.folded.values())
    assert len(result.weights.norms) == 2 * arch.describe().layers


def test_a_family_without_scale_groups_is_left_as_it_is(tiny_phi3, calibration_text, caplog):
    """Phi-3 (fused qkv / gate_up) declares no groups: nothing is folded, and the log says so."""
    arch = open_architecture(Checkpoint.open(tiny_phi3("phi4-mini")))
    assert arch.scale_groups() == []
    options = ExportOptions(quant=QuantScheme(4, 32))
    with caplog.at_level("WARNING"):
        result = scale_and_fold(arch, Calibration(calibration_text, 2, 32, CalibMethod.AWQ),
                                Schemes(arch, options).linear, quantizers(False))
    assert not result.folded and not result.weights.norms and not result.weights.factors
    assert "0 group(s) awq-scaled" in caplog.text


def test_verification_reads_the_folded_norms(tiny_decoder, tmp_path, calibration_text):
    path = tiny_decoder("llama3")
    out = tmp_path / "out"
    export(path, out, ExportOptions(quant=QuantScheme(4, 32),
                                    calibration=Calibration(calibration_text, 2, 32, CalibMethod.AWQ)))
    arch = open_architecture(Checkpoint.open(path))
    stored = stored_tensors(out, arch)
    norm = arch.scale_groups()[0].norm
    assert (out / FOLDED_NORMS).exists() and norm is not None
    assert not torch.equal(stored.read(norm), stored.base.read(norm))  # the oracle's norm is the folded one
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["options"]["calibration"]["method"] == "awq"


@pytest.mark.slow
@pytest.mark.parametrize("builder, method, base", [("llama", "awq", QuantMethod.RTN),
                                                   ("gemma4", "awq+gptq", QuantMethod.RTN),
                                                   ("llama", "smooth", QuantMethod.HQQ)])
def test_scaled_export_verifies(tmp_path, calibration_text, builder, method, base):
    """MNN's runtime runs the folded graph as the HF model carrying the stored (folded) weights does
    (the records rounded by RTN or HQQ, after the scales)."""
    from llmexport.tiny.registry import TINY_BUILDERS

    path = TINY_BUILDERS[builder](tmp_path / "model", 0)
    out = tmp_path / "out"
    export(path, out, ExportOptions(quant=QuantScheme(4, 32, method=base),
                                    calibration=Calibration(calibration_text, 4, 64, CalibMethod(method))))
    report = verify_export(out, path, steps=12)
    assert report.passed, report.failures
    assert report.exact_kernels is None or report.exact_kernels.max_abs_err < 1e-3
    if method == "awq":  # the graph holds the folded norms: an oracle with the checkpoint's disagrees
        (out / FOLDED_NORMS).unlink()
        assert not verify_export(out, path, steps=12).passed


def test_cli_refuses_scaling_it_cannot_use(tiny_decoder, tmp_path, calibration_text):
    path = str(tiny_decoder("llama3"))
    cases = [(["--calib_method", "awq"], "--calib_method awq: needs the calibration text"),
             (["--calib_method", "smooth"], "--calib_method smooth: needs the calibration text"),
             (["--calib_data", str(calibration_text), "--smooth_alpha", "0.5"], "--smooth_alpha: tunes"),
             (["--calib_data", str(calibration_text), "--calib_method", "smooth", "--smooth_alpha", "1.5"],
              "--smooth_alpha: must be between 0 and 1")]
    for extra, phrase in cases:
        dst = tmp_path / f"dst{len(os.listdir(tmp_path))}"
        result = CliRunner().invoke(main, ["--path", path, "--dst_path", str(dst), *extra])
        assert result.exit_code == 2 and phrase in result.output, (extra, result.output)
        assert result.output.strip().count("\n") == 0 and not dst.exists()
