"""HQQ zero-point quantizer: the ``hqq`` package's solver, exact decoding through the MNN record,
and never a block worse than RTN."""

from __future__ import annotations

import io

import hqq.core.optimize
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import llmexport.quant.hqq as hqq_module
from llmexport.mnn.weight_reader import read_linear
from llmexport.mnn.weights import WeightFileWriter
from llmexport.quant.hqq import quantize_hqq
from llmexport.quant.methods import quantizer_for
from llmexport.quant.rtn import dequantize, quantize_rtn
from llmexport.quant.scheme import QuantMethod, QuantScheme


def realistic_matrices(seed: int = 0) -> dict[str, torch.Tensor]:
    """LLM-like weights: heavy-tailed rows, a few outlier input channels, and one gaussian."""
    out: dict[str, torch.Tensor] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for (oc, ic), dof, n_outliers in (((256, 512), 3.0, 4), ((512, 256), 4.0, 3),
                                          ((384, 1024), 5.0, 6), ((512, 512), 3.5, 8)):
            w = torch.distributions.StudentT(dof).sample((oc, ic)) * 0.02
            cols = torch.randperm(ic)[:n_outliers]
            w[:, cols] *= 10 + 40 * torch.rand(n_outliers)
            out[f"t{dof:g}_{oc}x{ic}"] = w
        out["gauss_512x512"] = torch.randn(512, 512) * 0.02
    return out


def _errors(w: torch.Tensor, bits: int, block: int) -> tuple[float, float, float, float]:
    d_rtn = dequantize(quantize_rtn(w, bits, block)) - w
    d_hqq = dequantize(quantize_hqq(w, bits, block)) - w
    return (float(d_rtn.norm()), float(d_hqq.norm()), float(d_rtn.abs().mean()), float(d_hqq.abs().mean()))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_record_decodes_exactly(bits: int) -> None:
    w = realistic_matrices()["t3_256x512"][:64]
    bias = None if bits == 4 else torch.randn(64)
    scheme = QuantScheme(bits, 64, method=QuantMethod.HQQ)
    buf = io.BytesIO()
    rec = WeightFileWriter(buf).write_linear(w, bias, scheme, quantizer=quantize_hqq)
    weight, read_bias = read_linear(buf.getvalue(), rec.external(), rec.quan_parameter(), 64, 512)
    assert torch.equal(weight, dequantize(quantize_hqq(w, bits, 64)))
    assert read_bias is None if bias is None else torch.equal(read_bias, bias)


def test_record_of_a_sliced_tensor_decodes_to_the_whole_tensor_result() -> None:
    # The writer quantizes row slices of ~1M values; the record must still hold quantize_hqq(w).
    w = torch.cat([realistic_matrices()["t3.5_512x512"]] * 2, 1).repeat(5, 1)  # 2.6M values: 3 slices
    buf = io.BytesIO()
    rec = WeightFileWriter(buf).write_linear(w, None, QuantScheme(4, 64, method=QuantMethod.HQQ),
                                             quantizer=quantize_hqq)
    weight, _ = read_linear(buf.getvalue(), rec.external(), rec.quan_parameter(), 2560, 1024)
    assert torch.equal(weight, dequantize(quantize_hqq(w, 4, 64)))


def test_alpha_is_fp16_exact_and_q_matches_stored_grid() -> None:
    w = realistic_matrices()["t4_512x256"]
    qt = quantize_hqq(w, 4, 64)
    for t in (qt.scale, qt.zero):
        assert torch.equal(t.to(torch.float16).to(torch.float32), t)
    # q is the nearest level against the stored (rounded) scale/zero, clamped to range.
    wb = w.reshape(512, 4, 64)
    expect = torch.round((wb - qt.zero[..., None]) / qt.scale[..., None]).clamp(-8, 7)
    assert torch.equal(qt.q.to(torch.float32), expect)
    # HQQ changes zeros only: the scales are RTN's.
    assert torch.equal(qt.scale, quantize_rtn(w, 4, 64).scale)


def test_hqq_beats_rtn_at_4bit_on_every_matrix() -> None:
    for name, w in realistic_matrices().items():
        rtn_fro, hqq_fro, rtn_mae, hqq_mae = _errors(w, 4, 64)
        print(f"4-bit {name}: fro HQQ/RTN {hqq_fro / rtn_fro:.3f}  mae HQQ/RTN {hqq_mae / rtn_mae:.3f}")
        assert hqq_fro < rtn_fro, name
        assert hqq_mae < rtn_mae, name


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_no_block_worse_than_rtn(bits: int) -> None:
    w = realistic_matrices()["t5_384x1024"]
    blocks = w.reshape(384, 16, 64)
    err_rtn = (dequantize(quantize_rtn(w, bits, 64)).reshape(384, 16, 64) - blocks).abs().mean(-1)
    err_hqq = (dequantize(quantize_hqq(w, bits, 64)).reshape(384, 16, 64) - blocks).abs().mean(-1)
    assert bool((err_hqq <= err_rtn).all())
    assert float((err_hqq < err_rtn).float().mean()) > 0.5  # and most blocks do improve


def test_hqq_not_worse_at_8bit() -> None:
    for name, w in realistic_matrices().items():
        rtn_fro, hqq_fro, rtn_mae, hqq_mae = _errors(w, 8, 64)
        print(f"8-bit {name}: fro HQQ/RTN {hqq_fro / rtn_fro:.3f}  mae HQQ/RTN {hqq_mae / rtn_mae:.3f}")
        assert hqq_fro <= rtn_fro, name
        assert hqq_mae <= rtn_mae, name


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("block", [0, 32, 64, 128])
def test_sweep_levels_in_range(bits: int, block: int) -> None:
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(bits * 1000 + block)) * 0.05
    used = QuantScheme(bits, block).block_for(256)
    qt = quantize_hqq(w, bits, used)
    half = 1 << (bits - 1)
    assert qt.q.shape == (48, 256 // used, used) and qt.q.dtype == torch.int8
    assert int(qt.q.min()) >= -half and int(qt.q.max()) <= half - 1
    assert qt.zero is not None and qt.bits == bits and qt.block == used
    err_hqq = (dequantize(qt) - w).abs().mean()
    err_rtn = (dequantize(quantize_rtn(w, bits, used)) - w).abs().mean()
    assert err_hqq <= err_rtn


def test_chunked_rows_equal_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    # The package runs without its tensor-wide early stop: each block's zero depends on that block
    # alone, so not on which rows or blocks share a call (the writers quantize row slices).
    w = realistic_matrices()["t3_256x512"]
    whole = quantize_hqq(w, 4, 64)
    chunked = quantize_hqq(w, 4, 64, chunk_elements=512 * 24)  # 24 rows at a time, 11 chunks
    assert torch.equal(whole.q, chunked.q) and torch.equal(whole.zero, chunked.zero)
    monkeypatch.setattr(hqq_module, "_SOLVER_ELEMENTS_CPU", 64 * 7)  # 7 blocks per call of the package
    split = quantize_hqq(w, 4, 64)
    assert torch.equal(whole.q, split.q) and torch.equal(whole.zero, split.zero)


def test_zeros_come_from_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every call goes to hqq's proximal solver, with its defaults but fp32 and no early stop, one
    row per block; a block that takes HQQ stores the package's zero, converted and rounded to fp16."""
    calls = []
    package = hqq.core.optimize.optimize_weights_proximal_v2

    def spy(tensor, scale, zero, min_max, **kwargs):
        out = package(tensor, scale, zero, min_max, **kwargs)
        calls.append((tensor.clone(), scale.clone(), zero.clone(), min_max, kwargs, out[2].clone()))
        return out

    monkeypatch.setattr(hqq_module, "optimize_weights_proximal_v2", spy)
    w = realistic_matrices()["t4_512x256"][:64]
    qt = quantize_hqq(w, 4, 64)
    assert len(calls) == 1
    tensor, s_inv, z_h, min_max, kwargs, z_opt = calls[0]
    assert tensor.shape == (64 * 4, 64) and torch.equal(tensor, w.reshape(-1, 64))
    assert min_max == [0, 15] and kwargs["axis"] == 1 and kwargs["dtype"] == torch.float32
    params = kwargs["opt_params"]
    assert (params["lp_norm"], params["beta"], params["kappa"], params["iters"]) == (0.7, 10.0, 1.01, 20)
    assert params["early_stop"] is False and params["scale_gridsearch"] is False
    # HQQ's start is RTN: s_inv = 1/scale, z_h = 8 - zero/scale (= -min * s_inv)
    rtn = quantize_rtn(w, 4, 64)
    torch.testing.assert_close(s_inv.reshape(-1), 1 / rtn.scale.reshape(-1))
    torch.testing.assert_close(z_h.reshape(-1), 8 - rtn.zero.reshape(-1) / rtn.scale.reshape(-1))
    expect = ((8 - z_opt.reshape(-1)) * rtn.scale.reshape(-1)).to(torch.float16).float()
    took = qt.zero.reshape(-1) != rtn.zero.reshape(-1)
    assert float(took.float().mean()) > 0.5
    assert torch.equal(qt.zero.reshape(-1)[took], expect[took])


def _outlier_matrix(seed: int, rows: int, width: int, dof: float, outliers: int, magnitude: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.distributions.StudentT(dof).sample((rows, width)) * magnitude
    w[:, torch.randperm(width, generator=gen)[:outliers]] *= 20
    return w


@settings(max_examples=25, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), bits=st.sampled_from([2, 3, 4, 8]), block=st.sampled_from([16, 32, 64]),
       nblocks=st.integers(1, 4), rows=st.integers(1, 24), dof=st.floats(2.0, 30.0),
       outliers=st.integers(0, 3), magnitude=st.sampled_from([1e-4, 2e-2, 1.0]))
def test_properties(seed: int, bits: int, block: int, nblocks: int, rows: int, dof: float, outliers: int,
                    magnitude: float) -> None:
    """On random heavy-tailed weights of any scale: the scales are RTN's; scale and zero are fp16
    values and each level the nearest to its weight on that stored grid (what MNN decodes); no
    block's mean absolute error is above RTN's; the row chunking changes nothing."""
    torch.manual_seed(seed)
    width = block * nblocks
    w = _outlier_matrix(seed, rows, width, dof, outliers, magnitude)
    qt = quantize_hqq(w, bits, block)
    rtn = quantize_rtn(w, bits, block)
    assert qt.zero is not None and torch.equal(qt.scale, rtn.scale)
    assert torch.equal(qt.zero.to(torch.float16).float(), qt.zero)
    half = 1 << (bits - 1)
    wb = w.reshape(rows, nblocks, block)
    live = qt.scale > 0
    step = torch.where(live, qt.scale, torch.ones_like(qt.scale))
    levels = torch.round((wb - qt.zero[..., None]) / step[..., None]).clamp(-half, half - 1)
    assert torch.equal(qt.q.float()[live], levels[live])
    err = (dequantize(qt).reshape(wb.shape) - wb).abs().mean(-1)
    err_rtn = (dequantize(rtn).reshape(wb.shape) - wb).abs().mean(-1)
    assert bool((err <= err_rtn).all())
    one_row = quantize_hqq(w, bits, block, chunk_elements=1)
    assert torch.equal(one_row.q, qt.q) and torch.equal(one_row.zero, qt.zero)


def test_constant_and_zero_blocks_stay_finite() -> None:
    w = torch.randn(16, 128) * 0.02
    w[0] = 0.0                      # all-zero row
    w[1] = 0.375                    # constant row
    w[2, :64] = 0.0                 # zero block next to a normal one
    w[3, 64:] = -1e-6               # constant tiny block
    w[4, :64] = torch.tensor([0.0, 1e-3]).repeat(32)  # two-valued block
    for bits in (2, 3, 4, 8):
        qt = quantize_hqq(w, bits, 64)
        out = dequantize(qt)
        assert torch.isfinite(qt.scale).all() and torch.isfinite(qt.zero).all()
        assert torch.isfinite(out).all()
        assert torch.equal(out[0], w[0]) and torch.equal(out[2, :64], w[2, :64])
        assert torch.allclose(out[1], w[1]) and torch.allclose(out[4, :64], w[4, :64], atol=1e-6)


def test_sym_falls_back_to_rtn_and_dispatch() -> None:
    w = realistic_matrices()["gauss_512x512"][:32]
    sym = quantize_hqq(w, 4, 64, sym=True)
    ref = quantize_rtn(w, 4, 64, sym=True)
    assert sym.zero is None and torch.equal(sym.q, ref.q) and torch.equal(sym.scale, ref.scale)
    assert quantizer_for(QuantMethod.HQQ) is quantize_hqq
    assert quantizer_for(QuantMethod.RTN) is quantize_rtn
    assert quantizer_for("hqq") is quantize_hqq
    with pytest.raises(ValueError, match="'stored' has no quantizer"):
        quantizer_for(QuantMethod.STORED)
    # iters=0 is RTN exactly
    zero_iters = quantize_hqq(w, 4, 64, iters=0)
    rtn = quantize_rtn(w, 4, 64)
    assert torch.equal(zero_iters.q, rtn.q) and torch.equal(zero_iters.zero, rtn.zero)


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        quantize_hqq(torch.randn(4, 100), 4, 64)
    with pytest.raises(ValueError):
        quantize_hqq(torch.tensor([[float("nan")] * 64]), 4, 64)
    with pytest.raises(ValueError):
        quantize_hqq(torch.randn(4, 64), 4, 64, lp_norm=1.5)
    for bad in (dict(iters=1), dict(iters=-1), dict(kappa=1.0), dict(beta=0.0)):  # the package asserts these
        with pytest.raises(ValueError):
            quantize_hqq(torch.randn(4, 64), 4, 64, **bad)
