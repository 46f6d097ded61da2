"""Verification runs only code the user allowed, on the weights the export read: a checkpoint's own
modeling code needs --trust_remote_code, and a pickle beside the safetensors is never loaded."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from llmexport.cli import main
from llmexport.errors import UsageError

from hostile import assert_refused, copy_model, make_old_dst, snapshot


def test_verify_of_a_remote_code_family_needs_trust_remote_code(tiny_k2_horizon, tmp_path, monkeypatch):
    from llmexport.trace import onnx_export

    def no_onnx(*args, **kwargs):
        raise AssertionError("work started before the remote-code check")

    monkeypatch.setattr(onnx_export, "export_onnx", no_onnx)
    model = copy_model(tiny_k2_horizon("dense"), tmp_path)
    dst = make_old_dst(tmp_path)
    before = snapshot(tmp_path)
    result = CliRunner().invoke(main, ["--path", str(model), "--dst_path", str(dst), "--verify"])
    assert_refused(result.exit_code, result.output, tmp_path, before, ["--trust_remote_code", "k2_horizon"], (2,))


def test_verify_api_refuses_remote_code_unless_trusted(tiny_k2_horizon, tmp_path):
    import llmexport
    import llmexport.verification.verify  # noqa: F401  (an export with --verify imports it: the API must stay callable)

    with pytest.raises(UsageError, match="trust_remote_code"):
        llmexport.verify(tmp_path, tiny_k2_horizon("dense"))


def test_plain_export_of_a_remote_code_family_needs_no_trust(tiny_k2_horizon, tmp_path):
    result = CliRunner().invoke(main, ["--path", str(tiny_k2_horizon("dense")), "--dst_path", str(tmp_path / "o"),
                                       "--export", "onnx", "--quiet"])
    assert result.exit_code == 0, result.output


@pytest.mark.slow
def test_verify_reads_the_safetensors_never_a_pickle_beside_them(tiny_gemma4, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = copy_model(tiny_gemma4("31b", text_only=True), tmp_path)
    state = load_file(str(model / "model.safetensors"))
    poisoned = {k: (v * 0 if k.endswith("norm.weight") else v) for k, v in state.items()}
    torch.save(poisoned, model / "pytorch_model.bin")
    # The hazard is real: a loader that takes the pickle gets other weights.
    pickled = AutoModelForCausalLM.from_pretrained(model, use_safetensors=False, dtype=torch.float32)
    assert float(pickled.model.norm.weight.detach().abs().sum()) == 0.0
    result = CliRunner().invoke(main, ["--path", str(model), "--dst_path", str(tmp_path / "out"), "--quant_bit", "16",
                                       "--verify", "--quiet"])
    assert result.exit_code == 0, result.output
