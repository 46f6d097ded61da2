"""GPTQ and AWQ checkpoints exported "as stored": their integers reach MNN unchanged where an MNN
block holds a group, and are quantized afresh, with the reason, where it cannot (act-order).

Fixtures are packed by tests/gptq_awq_packer.py from the published formats (independent of the
reader). Every transcoded record must hold the checkpoint's integers and decode, read back from
our files in fp32, to exactly ``scale * (q - zero)``; MNN's runtime must agree with the HF model
carrying the read-back weights.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from gptq_awq_packer import (
    awq_tensors,
    dequantize,
    gptq_tensors,
    group_indices,
    quantize,
    quantize_checkpoint,
    read_zeros,
    word_stream,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from llmexport import ExportOptions, export, plan
from llmexport.cli import main
from llmexport.errors import InputError
from llmexport.mnn.readback import linear_records
from llmexport.mnn.weight_reader import read_levels, read_linear
from llmexport.mnn.weights import WeightFileWriter
from llmexport.quant.scheme import QuantMethod, QuantScheme
from llmexport.source.checkpoint import SafetensorsIndex
from llmexport.source.importers.gptq_awq import PackedWeights, packed_format

from hostile import assert_refused, snapshot

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}


def _packed_linear(folder: Path, method: str, bits: int, group: int, sym: bool = False, v1: bool = True,
                   act_order: bool = False, shape: tuple[int, int] = (64, 96), seed: int = 0):
    """One packed linear ``lin`` in ``folder``: (store, reference fp32, levels [out, in])."""
    torch.manual_seed(seed)
    w = torch.randn(shape) * 0.05
    groups = group_indices(shape[1], group, act_order, seed)
    q, zeros, scales = quantize(w, bits, groups, sym)
    if method == "gptq":
        tensors, config = gptq_tensors(q, zeros, scales, bits, groups, v1), dict(GPTQ, bits=bits, group_size=group)
        config["checkpoint_format"] = "gptq" if v1 else "gptq_v2"
        zeros = read_zeros(zeros, bits) if v1 else zeros
    else:
        tensors, config = awq_tensors(q, zeros, scales), dict(AWQ, group_size=group)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({f"lin.{k}": v for k, v in tensors.items()}, folder / "model.safetensors")
    store = PackedWeights(SafetensorsIndex.open(folder), packed_format(config, "config.json"), str(folder))
    return store, dequantize(q, zeros, scales, groups), q


# --- format units ------------------------------------------------------------------------------------
def test_word_layouts_match_the_published_examples():
    # GPTQ 4-bit: inputs 0..7 of one output column fill one word, the first in the low nibble
    assert word_stream(np.arange(8)[None], 4)[0, 0] == 0x76543210
    # AWQ: slot j of a word holds column (0, 2, 4, 6, 1, 3, 5, 7)[j]
    q = torch.arange(8)[:, None].repeat(1, 32)  # [out 8, in 32]: every input of column c holds c
    words = awq_tensors(q, torch.zeros(8, 1, dtype=torch.long),
                        torch.ones(8, 1, dtype=torch.float16))["qweight"]
    assert words.shape == (32, 1) and int(words[0, 0]) == 0x75316420
    # GPTQ 3-bit: value 10 straddles words 0 and 1 (its two low bits on top of word 0)
    values = np.zeros((1, 32), dtype=np.int64)
    values[0, 10] = 0b101
    assert [int(w) & 0xFFFFFFFF for w in word_stream(values, 3)[0]] == [1 << 30, 1, 0]


@settings(max_examples=30, deadline=None)
@given(method=st.sampled_from(["gptq", "awq"]), bits=st.sampled_from([2, 3, 4, 8]),
       group=st.sampled_from([32, 64, -1]), out=st.sampled_from([32, 64, 96]), blocks=st.integers(1, 4),
       sym=st.booleans(), v1=st.booleans(), act_order=st.booleans(), seed=st.integers(0, 1000))
def test_packer_round_trip_and_dequantization(method, bits, group, out, blocks, sym, v1, act_order, seed):
    bits = 4 if method == "awq" else bits
    width = blocks * 64
    with tempfile.TemporaryDirectory() as tmp:
        store, reference, q = _packed_linear(Path(tmp), method, bits, group, sym, v1,
                                             act_order and method == "gptq", (out, width), seed)
        assert store.shape("lin.weight") == (out, width) and store.names() == ["lin.weight"]
        assert torch.equal(store.tensor("lin.weight"), reference)
        if store.unfit("lin.weight") is None:
            pq = store.prequantized("lin.weight")
            assert torch.equal(pq.levels.long(), q) and torch.equal(pq.dequantize(), reference)
        else:
            assert act_order and "act-order" in store.unfit("lin.weight")


def test_v1_zero_of_zero_reads_as_the_kernels_read_it(tmp_path):
    """GPTQ v1 stores zero - 1: a zero of 0 wraps to 2^bits - 1 and reads back as 2^bits."""
    q = torch.zeros(32, 32, dtype=torch.long)
    zeros, scales, groups = torch.zeros(32, 1, dtype=torch.long), torch.ones(32, 1, dtype=torch.float16), \
        torch.zeros(32, dtype=torch.long)
    tensors = gptq_tensors(q, zeros, scales, 4, groups)
    save_file({f"lin.{k}": v for k, v in tensors.items()}, tmp_path / "model.safetensors")
    store = PackedWeights(SafetensorsIndex.open(tmp_path), packed_format(dict(GPTQ, group_size=-1), "c"), "f")
    assert torch.equal(store.tensor("lin.weight"), torch.full((32, 32), -16.0))


# which (method, bits, group, sym, v1) MNN records hold exactly: every bit width GPTQ packs, groups that
# are MNN blocks and group -1 (one block per row, here a width of 96 that is no block), both zero forms
FORMS = [("gptq", bits, group, sym, True) for bits in (2, 3, 4, 8) for group in (32, -1) for sym in (False, True)] + \
        [("gptq", 4, 64, False, False), ("gptq", 3, 128, True, False), ("awq", 4, 32, False, True),
         ("awq", 4, -1, False, True)]


@pytest.mark.parametrize("method,bits,group,sym,v1", FORMS)
def test_transcoded_record_holds_the_integers_and_decodes_exactly(tmp_path, method, bits, group, sym, v1):
    width = 128 if group == 128 else 96 if group != 64 else 128
    store, reference, q = _packed_linear(tmp_path / "ckpt", method, bits, group, sym, v1, shape=(64, width))
    assert store.unfit("lin.weight") is None and store.quantization("lin.weight")[0].sym == sym
    block = group if group in (32, 64, 128, 256) else 0
    path, bias = tmp_path / "w.bin", torch.randn(64)
    with open(path, "wb") as f:  # sym: MNN's symmetric record, scales only
        record = WeightFileWriter(f, 0).write_linear(store.prequantized("lin.weight"), bias,
                                                     QuantScheme(bits, block, sym, method=QuantMethod.STORED))
    qp, blocks = record.quan_parameter(), width // (group if group > 0 else width)
    assert qp["scaleStorage"] == "FP32" and qp["readType"] == (0 if sym else 64 * blocks)
    assert record.alpha_bytes == 64 * blocks * 4 * (1 if sym else 2)
    levels, _ = read_levels(path, record.external(), qp, 64, width)
    assert np.array_equal(levels + (1 << (bits - 1)), q.numpy())
    weight, read_bias = read_linear(path, record.external(), qp, 64, width)
    assert float((weight - reference).abs().max()) == 0.0 and torch.equal(read_bias, bias)


# --- whole checkpoints: what is kept, what is not and why ---------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from llmexport.tiny.decoders import build_tiny_decoder

    return build_tiny_decoder(tmp_path_factory.mktemp("hf") / "llama3", "llama3", dtype=torch.float16)


def _checkpoint(tiny_llama, tmp_path, method="gptq", **kwargs):
    out = tmp_path / f"{method}-ckpt"
    return out, quantize_checkpoint(tiny_llama, out, method, **kwargs)


@pytest.mark.parametrize("kwargs,kept,reasons", [
    (dict(bits=3, group=32, sym=True), 28, {}),  # 3-bit packing maps: MNN records hold 3-bit levels
    (dict(bits=4, group=-1, v1=False), 28, {}),
    (dict(act_order=True), 0, {"model.layers.0.self_attn.q_proj": "act-order"}),
    (dict(group=64), 24, {"model.layers.0.mlp.down_proj": "does not divide the input width 96"}),
    (dict(group=16), 28, {}),  # llama.cpp's Q6_K block: MNN derives 16-value blocks as well
    (dict(group=8), 0, {"model.layers.0.mlp.up_proj": "group 8: kept MNN blocks are"}),
])
def test_plan_keeps_what_maps_and_says_why_not(tiny_llama, tmp_path, kwargs, kept, reasons):
    path, reference = _checkpoint(tiny_llama, tmp_path, **kwargs)
    pre = plan(path, ExportOptions()).prequantized
    assert pre.format == ("gptq_v2" if kwargs.get("v1") is False else "gptq") and pre.transcoded == kept
    requantized = {e.name: e.reason for e in pre.requantized}
    assert len(requantized) == 28 - kept and all(r in requantized[n] for n, r in reasons.items())
    assert set(pre.kept_float) == {"lm_head"}  # fp16 in the checkpoint: kept as an fp16 record
    store = PackedWeights(SafetensorsIndex.open(path), packed_format(
        json.loads((path / "config.json").read_text())["quantization_config"], "c"), str(path))
    for name, value in reference.items():  # act-order's dequantization follows g_idx
        assert torch.equal(store.tensor(name), value), name


def test_a_packed_lm_head_is_kept_too(tiny_llama, tmp_path):
    path, reference = _checkpoint(tiny_llama, tmp_path, "awq", lm_head=True)
    pre = plan(path, ExportOptions()).prequantized
    assert pre.transcoded == 29 and not pre.kept_float and not pre.requantized and "lm_head.weight" in reference


def test_calibration_needs_requantize(tiny_llama, tmp_path):
    path, _ = _checkpoint(tiny_llama, tmp_path)
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    result = CliRunner().invoke(main, ["--path", str(path), "--dst_path", str(tmp_path / "x"), "--dry-run",
                                       "--calib_data", str(text)])
    assert result.exit_code == 2 and "pre-quantized checkpoint keeps its stored integers" in result.output


def test_requantize_and_dry_run_name_the_format(tiny_llama, tmp_path):
    path, _ = _checkpoint(tiny_llama, tmp_path, "awq")
    assert plan(path, ExportOptions(requantize=True)).prequantized.transcoded == 0
    result = CliRunner().invoke(main, ["--path", str(path), "--dst_path", str(tmp_path / "x"), "--dry-run"])
    assert result.exit_code == 0 and "AWQ checkpoint, as stored by default: 28 linear(s) keep" in result.output


# --- bad input: one line naming the file and key, nothing written -------------------------------------
def _break_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _break_tensors(path: Path, drop: str | None = None, replace: tuple[str, torch.Tensor] | None = None) -> None:
    tensors = load_file(path / "model.safetensors")
    if drop:
        del tensors[drop]
    if replace:
        tensors[replace[0]] = replace[1]
    save_file(tensors, path / "model.safetensors")


Q = "model.layers.0.self_attn.q_proj"
BAD = {
    "missing qzeros": ("gptq", lambda p: _break_tensors(p, drop=f"{Q}.qzeros"), f"{Q}.qzeros is missing"),
    "awq gemv": ("awq", lambda p: _break_config(p, version="gemv"), "quantization_config.version 'gemv'"),
    "bits 5": ("gptq", lambda p: _break_config(p, bits=5), "quantization_config.bits 5: GPTQ packs 2, 3, 4, 8"),
    "gptq marlin": ("gptq", lambda p: _break_config(p, checkpoint_format="marlin"), "checkpoint_format 'marlin'"),
    "other method": ("gptq", lambda p: _break_config(p, quant_method="bitsandbytes"),
                     "'bitsandbytes' is not supported"),
    "scales shape": ("gptq", lambda p: _break_tensors(p, replace=(f"{Q}.scales", torch.ones(3, 64).half())),
                     f"{Q}.scales is [3, 64], expected [2, 64]"),
    "group vs shape": ("awq", lambda p: _break_config(p, group_size=16), "scales is [3, 64], expected [6, 64]"),
    "g_idx range": ("gptq", lambda p: _break_tensors(p, replace=(f"{Q}.g_idx",
                                                                 torch.full((64,), 9, dtype=torch.int32))),
                    f"{Q}.g_idx: group indices must lie in [0, 2)"),
    "orphan g_idx": ("gptq", lambda p: _break_tensors(p, replace=("model.norm.g_idx",
                                                                   torch.zeros(64, dtype=torch.int32))),
                     "model.norm.g_idx has no model.norm.qweight"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_checkpoints_are_refused_in_one_line(tiny_llama, tmp_path, case):
    method, breaker, needle = BAD[case]
    work = tmp_path / "work"
    path, _ = _checkpoint(tiny_llama, work, method)
    breaker(path)
    dst = work / "dst"
    before = snapshot(work)
    result = CliRunner().invoke(main, ["--path", str(path), "--dst_path", str(dst)])
    assert_refused(result.exit_code, result.output, work, before, (needle, str(path)))


def test_format_errors_name_the_key():
    with pytest.raises(InputError, match="quantization_config.zero_point False"):
        packed_format(dict(AWQ, zero_point=False), "config.json")
    with pytest.raises(InputError, match="group_size 0"):
        packed_format(dict(GPTQ, group_size=0), "config.json")
    with pytest.raises(InputError, match="quantization_config.dynamic"):
        packed_format(dict(GPTQ, dynamic={"+:.*down_proj": {"bits": 8}}), "config.json")
    with pytest.raises(InputError, match="pack_dtype 'int16'"):
        packed_format(dict(GPTQ, pack_dtype="int16"), "config.json")


# --- end to end: export, records read back, --verify ---------------------------------------------------
def _check_records(out: Path, reference: dict[str, torch.Tensor], transcoded: set[str]) -> float:
    """The largest |read-back record - dequantized checkpoint| over the transcoded linears."""
    worst = 0.0
    for name, rec in linear_records(out).items():
        if name in transcoded:
            decoded, _ = read_linear(out / "llm.mnn.weight", rec["external"], rec["quanParameter"], rec["oc"],
                                     rec["ic"])
            worst = max(worst, float((decoded - reference[name + ".weight"]).abs().max()))
    return worst


@pytest.fixture(scope="module")
def tiny_gemma4_text(tmp_path_factory):
    from llmexport.tiny.gemma4 import build_tiny_gemma4

    return build_tiny_gemma4(tmp_path_factory.mktemp("hf") / "gemma4", "31b", dtype=torch.float16, text_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("model,method,kwargs,kept", [
    ("llama", "gptq", dict(bits=4, group=32), 28), ("llama", "awq", dict(group=32), 28),
    ("llama", "gptq", dict(bits=3, group=-1, sym=True, v1=False), 28),
    ("llama", "gptq", dict(act_order=True), 0),  # requantized (4-bit block 64 RTN) from the dequantized weights
    ("gemma4", "gptq", dict(bits=4, group=32), 40),  # Gemma4 text: sliding/full layers, a tied fp16 lm_head
])
def test_gptq_awq_checkpoint_exports_and_verifies(tiny_llama, tiny_gemma4_text, tmp_path, model, method, kwargs,
                                                  kept):
    from llmexport.verification.verify import summary_line, verify_export

    hf = tiny_llama if model == "llama" else tiny_gemma4_text
    path, reference = _checkpoint(hf, tmp_path, method, **kwargs)
    result = export(path, tmp_path / "out", ExportOptions())
    pre = result.plan.prequantized
    transcoded = {linear.name for linear in result.plan.linears if linear.method is QuantMethod.STORED}
    assert len(transcoded) == pre.transcoded == kept and len(pre.requantized) == len(reference) - kept
    # GPTQ sym (every zero 2^(bits-1)): MNN's symmetric records, scales only
    assert {linear.sym for linear in result.plan.linears if linear.name in transcoded} <= {kwargs.get("sym", False)}
    assert _check_records(result.dst, reference, transcoded) == 0.0
    assert json.loads((result.dst / "manifest.json").read_text())["prequantized"]["transcoded"] == kept
    report = verify_export(result.dst, path, steps=24)
    print(f"\n{model} {method} {kwargs}: {summary_line(report)}")
    assert report.passed and report.prequantized["linears_exact"] == kept + 1  # + the fp16 lm_head
    assert report.prequantized["fp32_alpha_records"] == kept
    assert set(report.prequantized["linears_changed"]) == {e.name for e in pre.requantized}


@pytest.mark.slow
def test_cli_verify_passes_on_a_gptq_checkpoint(tiny_llama, tmp_path):
    path, _ = _checkpoint(tiny_llama, tmp_path, "gptq")
    result = CliRunner().invoke(main, ["--path", str(path), "--dst_path", str(tmp_path / "out"), "--verify"])
    assert result.exit_code == 0, result.output[-2000:]
    report = json.loads((tmp_path / "out" / "verify.json").read_text())
    assert report["passed"] and report["prequantized"]["linears_exact"] == 29
