"""GPTQ calibration (``--calib_data``): the rounding (llmexport/quant/gptq.py), the calibration text
(llmexport/calibration/data.py) and the export that stores GPTQ's levels (llmexport/calibration/gptq.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmexport.api import export
from llmexport.calibration.data import calibration_windows, read_texts
from llmexport.calibration.gptq import calibrate
from llmexport.cli import main
from llmexport.errors import InputError
from llmexport.options import Calibration, ExportOptions
from llmexport.planning.schemes import Schemes
from llmexport.quant.gptq import calibration_loss, quantize_gptq
from llmexport.quant.hqq import quantize_hqq
from llmexport.quant.methods import quantizers
from llmexport.quant.rtn import dequantize, quantize_rtn
from llmexport.quant.scheme import QuantScheme
from llmexport.source.checkpoint import Checkpoint
from llmexport.source.loading import open_architecture
from llmexport.spec import LinearRole
from llmexport.tiny.byte_level_tokenizer import EXTRA_CORPUS
from llmexport.tiny.registry import TINY_BUILDERS
from llmexport.tiny.tokenizer import TRAINING_CORPUS
from llmexport.verification.verify import stored_tensors, verify_export

BASES = {"rtn": quantize_rtn, "hqq": quantize_hqq}


def _correlated_inputs(ic: int, rank: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2048, rank, generator=g) @ torch.randn(rank, ic, generator=g)
    return x + 0.05 * torch.randn(2048, ic, generator=g)


# --- the rounding ---------------------------------------------------------------------------------

@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 40)), deadline=None)
@given(bits=st.sampled_from([2, 3, 4, 8]), sym=st.booleans(), base=st.sampled_from(sorted(BASES)),
       block=st.sampled_from([16, 32, 64]), rank=st.integers(4, 96), seed=st.integers(0, 10_000))
def test_gptq_levels_sit_on_the_base_grids_and_never_lose_to_the_base(bits, sym, base, block, rank, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(24, 128, generator=g) * 0.02
    h = (lambda x: x.T @ x)(_correlated_inputs(128, rank, seed).double())
    qt = quantize_gptq(w, h, bits, block, sym, BASES[base])
    half = 1 << (bits - 1)
    assert qt.q.shape == (24, 128 // block, block) and int(qt.q.min()) >= -half and int(qt.q.max()) <= half - 1
    assert (qt.zero is None) == sym
    assert torch.equal(qt.scale, qt.scale.half().float())  # fp16 alpha, as the record stores it
    assert calibration_loss(w, qt, h) <= calibration_loss(w, BASES[base](w, bits, block, sym), h)


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_gptq_cuts_the_loss_of_correlated_inputs(bits):
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 0.02
    x = _correlated_inputs(256, 32, 2)
    h = x.T.double() @ x.double()
    rtn = quantize_rtn(w, bits, 64, False)
    gptq = quantize_gptq(w, h, bits, 64, False, quantize_rtn)
    ratio = calibration_loss(w, gptq, h) / calibration_loss(w, rtn, h)
    assert ratio < 0.3, ratio
    # and on inputs drawn afresh from the same distribution, not only on the calibration set
    x2 = _correlated_inputs(256, 32, 2)[:1024] + 0.01 * torch.randn(1024, 256)
    err = lambda qt: float(((w - dequantize(qt)) @ x2.T).pow(2).sum())  # noqa: E731
    assert err(gptq) < 0.5 * err(rtn)


def test_gptq_with_uncorrelated_inputs_is_the_base_rounding():
    """A diagonal Hessian propagates no error: GPTQ rounds every column as the base method does."""
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(3))
    h = torch.diag(torch.rand(128, generator=torch.Generator().manual_seed(4)) + 0.5).double()
    for sym in (False, True):
        assert torch.equal(quantize_gptq(w, h, 4, 32, sym, quantize_rtn).q, quantize_rtn(w, 4, 32, sym).q)


def test_gptq_survives_dead_inputs_and_rejects_a_wrong_hessian():
    w = torch.randn(8, 64)
    x = _correlated_inputs(64, 8, 5)
    x[:, :5] = 0  # inputs that never fire
    qt = quantize_gptq(w, x.T.double() @ x.double(), 4, 32, False, quantize_rtn)
    assert torch.isfinite(dequantize(qt)).all()
    with pytest.raises(ValueError, match="Hessian"):
        quantize_gptq(w, torch.eye(32, dtype=torch.float64), 4, 32, False, quantize_rtn)


# --- the calibration text ---------------------------------------------------------------------------

def test_plain_text_and_jsonl(tmp_path):
    plain = tmp_path / "a.txt"
    plain.write_text("one line\n\nanother\n")
    assert read_texts(plain) == ["one line\n\nanother\n"]
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text('{"text": "first"}\n\n"second"\n{"text": "third", "id": 3}\n')
    assert read_texts(jsonl) == ["first", "second", "third"]
    detected = tmp_path / "c.txt"
    detected.write_text('{"text": "x"}\n{"text": "y"}\n')
    assert read_texts(detected) == ["x", "y"]


BAD = {"missing": (None, "no such file"), "empty": (b"  \n\n", "empty"), "nul": (b"abc\0def", "binary"),
       "latin1": (b"caf\xe9 au lait", "not UTF-8"), "jsonl": (b'{"text": 1}\n', "line 1"),
       "jsonl-line-2": (b'{"text": "a"}\n[1, 2]\n', "line 2")}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_calibration_files_are_one_line_input_errors(tmp_path, case):
    data, phrase = BAD[case]
    path = tmp_path / ("x.jsonl" if case.startswith("jsonl") else "x.txt")
    if data is not None:
        path.write_bytes(data)
    with pytest.raises(InputError, match=phrase) as err:
        read_texts(path)
    assert str(err.value).startswith(f"--calib_data {path}: ") and "\n" not in str(err.value)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=200))
def test_any_bytes_give_texts_or_an_input_error(tmp_path, data):
    path = tmp_path / "fuzz.txt"
    path.write_bytes(data)
    try:
        texts = read_texts(path)
    except InputError as exc:
        assert "\n" not in str(exc)
    else:
        assert texts and all(isinstance(t, str) for t in texts)


class _CharTokenizer:
    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [ord(c) for c in text]}


def test_windows_spread_over_the_text_and_short_text_is_refused(tmp_path):
    text = "".join(chr(0x41 + i % 26) for i in range(1000))
    windows = calibration_windows(_CharTokenizer(), [text], Calibration(tmp_path / "t", samples=4, seq_len=100))
    assert windows.shape == (4, 100) and windows[0, 0] == 0x41 and windows[-1, -1] == ord(text[-1])
    few = calibration_windows(_CharTokenizer(), [text], Calibration(tmp_path / "t", samples=50, seq_len=100))
    assert few.shape == (10, 100)  # as many whole windows as the text holds
    with pytest.raises(InputError, match="needs at least 2000"):
        calibration_windows(_CharTokenizer(), [text], Calibration(tmp_path / "t", samples=1, seq_len=2000))


# --- the export -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def calibration_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "text.txt"
    path.write_text((TRAINING_CORPUS + EXTRA_CORPUS) * 3, encoding="utf-8")
    return path


@pytest.mark.parametrize("variant, bits", [("llama3", 4), ("llama3-tied", 8), ("qwen3-moe-mixed", 3)])
def test_calibrated_export_stores_the_gptq_levels(tiny_decoder, tmp_path, calibration_text, variant, bits):
    path = tiny_decoder(variant)
    calibration = Calibration(calibration_text, samples=4, seq_len=64)
    out = tmp_path / "out"
    export(path, out, ExportOptions(quant=QuantScheme(bits, 32), calibration=calibration))
    plain = tmp_path / "plain"
    export(path, plain, ExportOptions(quant=QuantScheme(bits, 32)))
    arch = open_architecture(Checkpoint.open(path))
    stored, rtn = stored_tensors(out, arch), stored_tensors(plain, arch)
    changed = [s.name for s in arch.linears()
               if not torch.equal(stored.read(arch.linear_source(s.name).weight),
                                  rtn.read(arch.linear_source(s.name).weight))]
    # experts (stacked in the reference) and fp16 routers keep their records; the rest, lm_head too, changed
    calibratable = {s.name for s in arch.linears() if s.role is LinearRole.LM_HEAD or s.role is not LinearRole.ROUTER
                    and arch.reference_slot(arch.linear_source(s.name).weight)[1] == ()}
    assert "lm_head" in calibratable
    assert set(changed) == calibratable and len(calibratable) >= 4 * 4
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["options"]["calibration"] == {"data": str(calibration_text), "samples": 4, "seq_len": 64}


@pytest.mark.slow
@pytest.mark.parametrize("builder", ["gemma4", "llama"])
def test_calibrated_export_verifies(tmp_path, calibration_text, builder):
    """The runtime decodes the GPTQ records as the stored-weights HF model holds them (exact kernels
    within float noise), for a plain decoder and Gemma4 with PLE and KV sharing."""
    from llmexport.tiny.registry import TINY_BUILDERS

    path = TINY_BUILDERS[builder](tmp_path / "model", 0)
    out = tmp_path / "out"
    export(path, out, ExportOptions(quant=QuantScheme(4, 32), calibration=Calibration(calibration_text, 4, 64)))
    report = verify_export(out, path, steps=12)
    assert report.passed, report.failures
    assert report.exact_kernels is None or report.exact_kernels.max_abs_err < 1e-3


def test_cli_refuses_calibration_it_cannot_use(tiny_decoder, tmp_path, calibration_text):
    path = str(tiny_decoder("llama3"))
    cases = [(["--quant_bit", "16"], "--quant_bit 16 has none"), (["--export", "onnx"], "only the MNN export"),
             (["--calib_samples", "0"], "--calib_samples"), (["--calib_seq_len", "4"], "--calib_seq_len")]
    for extra, phrase in cases:
        dst = tmp_path / f"dst{len(os.listdir(tmp_path))}"
        result = CliRunner().invoke(main, ["--path", path, "--dst_path", str(dst), "--calib_data",
                                           str(calibration_text), *extra])
        assert result.exit_code != 0 and phrase in result.output, (extra, result.output)
        assert not dst.exists()
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    dst = tmp_path / "dst-empty"
    result = CliRunner().invoke(main, ["--path", path, "--dst_path", str(dst), "--calib_data", str(empty)])
    assert result.exit_code == 3 and f"--calib_data {empty}: empty" in result.output
    assert not dst.exists()


KNOWN_SKIPS = {"not quantized by a calibratable method", "not one nn.Linear of the reference",
               "the export's weight is not the reference's parameter", "outside the decoder blocks",
               "not reached by the calibration tokens"}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(TINY_BUILDERS))
def test_every_family_calibrates(tmp_path, calibration_text, model_type):
    """Each registered family: most text linears GPTQ-rounded, none worse than its scheme's own
    method on the calibration data, the rest left alone for a known reason."""
    path = TINY_BUILDERS[model_type](tmp_path / "model", 0)
    arch = open_architecture(Checkpoint.open(path))
    options = ExportOptions(quant=QuantScheme(4, 32))
    result = calibrate(arch, Calibration(calibration_text, 2, 32), Schemes(arch, options).linear,
                       quantizers(False), tmp_path / "calibration", trust_remote_code=True)
    assert set(result.skipped.values()) <= KNOWN_SKIPS, result.skipped
    # the token mixers' linears (attention, or a recurrent layer's projections) by their role: at
    # least an input and an output projection per layer
    attention = [s.name for s in arch.linears() if s.role is LinearRole.ATTENTION and s.name in result.files]
    assert len(attention) >= 2 * arch.describe().layers, (model_type, result.skipped)
    assert all(ratio <= 1.0 for ratio in result.loss_ratio.values())
    assert set(result.files) | set(result.skipped) == {s.name for s in arch.linears()}
