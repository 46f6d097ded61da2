"""Bit packing, the quantization scheme and round-to-nearest quantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmexport.quant.pack import pack_bits, unpack_bits
from llmexport.quant.rtn import dequantize, quantize_rtn
from llmexport.quant.scheme import QuantMethod, QuantScheme

BITS = (2, 3, 4, 8)
BLOCKS = (0, 32, 64, 128, 256)


def _reference_pack(values: list[int], bits: int) -> bytes:
    """MSB-first bit stream built from a string of binary digits (independent of pack_bits)."""
    digits = "".join(format(v, f"0{bits}b") for v in values)
    digits += "0" * (-len(digits) % 8)
    return bytes(int(digits[i: i + 8], 2) for i in range(0, len(digits), 8))


# ---------------------------------------------------------------- packing

@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("count", [0, 1, 2, 3, 5, 7, 8, 9, 31, 1000, 1001])
def test_pack_round_trip_and_reference(bits: int, count: int) -> None:
    rng = np.random.default_rng(bits * 1000 + count)
    values = rng.integers(0, 1 << bits, size=count, dtype=np.uint8)
    packed = pack_bits(values, bits)
    assert len(packed) == (count * bits + 7) // 8
    assert packed == _reference_pack(values.tolist(), bits)
    assert np.array_equal(unpack_bits(packed, bits, count), values)


def test_pack_accepts_torch_tensors() -> None:
    values = torch.tensor([[1, 15], [0, 7]], dtype=torch.uint8)
    assert pack_bits(values, 4) == bytes([0x1F, 0x07])


@pytest.mark.parametrize(
    "values, bits, expected",
    [
        ([0xA, 0x5, 0xF], 4, bytes([0xA5, 0xF0])),  # first value in the high nibble
        ([3, 0, 1, 2, 1], 2, bytes([0b11000110, 0b01000000])),
        ([1, 2, 3, 4, 5, 6, 7, 0], 3, bytes([0x29, 0xCB, 0xB8])),  # 001010 011100 101110 111000
        ([0, 128, 255], 8, bytes([0, 128, 255])),
    ],
)
def test_pack_golden(values: list[int], bits: int, expected: bytes) -> None:
    assert pack_bits(np.array(values, dtype=np.uint8), bits) == expected


@pytest.mark.parametrize("bits", BITS)
def test_pack_rejects_out_of_range(bits: int) -> None:
    with pytest.raises(ValueError):
        pack_bits(np.array([1 << bits], dtype=np.int32), bits)
    with pytest.raises(ValueError):
        pack_bits(np.array([-1], dtype=np.int32), bits)


def test_unpack_rejects_short_buffer() -> None:
    with pytest.raises(ValueError):
        unpack_bits(b"\x00", 3, 3)


# ---------------------------------------------------------------- scheme

@pytest.mark.parametrize(
    "block, in_features, expected",
    [
        (0, 100, 100),
        (64, 128, 64),
        (64, 48, 48),      # narrower than the block: the whole width
        (64, 96, 48),      # largest multiple-of-8 divisor <= 64
        (256, 640, 160),   # not a power of two: any multiple of 8 qualifies
        (256, 2304, 256),
        (32, 40, 8),
        (64, 100, 100),    # no multiple-of-8 divisor: one block per row
        (64, 12, 12),
        (64, 8, 8),
        (128, 1, 1),
    ],
)
def test_block_for(block: int, in_features: int, expected: int) -> None:
    used = QuantScheme(bits=4, block=block).block_for(in_features)
    assert used == expected
    assert in_features % used == 0 and in_features // used >= 1


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("in_features", range(1, 300, 7))
def test_block_for_always_divides(block: int, in_features: int) -> None:
    used = QuantScheme(bits=4, block=block).block_for(in_features)
    assert in_features % used == 0
    assert used <= max(block, in_features) if block else used == in_features


@pytest.mark.parametrize("bits, block", [(5, 64), (1, 64), (32, 64), (4, 48), (4, 512), (4, -1)])
def test_validate_rejects(bits: int, block: int) -> None:
    with pytest.raises(ValueError, match="bits|block"):
        QuantScheme(bits=bits, block=block).validate()


def test_validate_accepts_and_method_values() -> None:
    for bits in (2, 3, 4, 8, 16):
        for block in BLOCKS:
            QuantScheme(bits=bits, block=block, sym=True).validate()
    assert QuantMethod("hqq") is QuantMethod.HQQ and QuantMethod.RTN == "rtn"
    assert QuantScheme(bits=16).is_fp16


# ---------------------------------------------------------------- RTN

@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("sym", [False, True])
def test_quantize_error_bound(bits: int, block: int, sym: bool) -> None:
    torch.manual_seed(bits * 10 + block)
    w = torch.randn(12, 256) * 0.05
    used = QuantScheme(bits=bits, block=block).block_for(256)
    qt = quantize_rtn(w, bits, used, sym)
    half = 1 << (bits - 1)
    assert qt.q.shape == (12, 256 // used, used) and qt.q.dtype == torch.int8
    assert int(qt.q.min()) >= -half and int(qt.q.max()) <= half - 1
    assert (qt.zero is None) == sym
    for t in (qt.scale,) + (() if sym else (qt.zero,)):
        assert t.dtype == torch.float32 and torch.equal(t.half().float(), t)  # already fp16-exact
    err = (dequantize(qt) - w).abs().reshape(12, -1, used)
    # Half a step, plus the fp16 rounding of the stored zero (a tiny fraction of a step here).
    slack = 1e-3 * qt.scale + (0 if sym else qt.zero.abs() * 2.0**-10)
    assert bool((err <= (qt.scale / 2 + slack).unsqueeze(-1)).all())


def test_quantize_fp32_scale_dtype_keeps_exact_range() -> None:
    w = torch.tensor([[0.1, 0.2, 0.3, 0.7]])
    qt = quantize_rtn(w, 8, 4, False, scale_dtype=torch.float32)
    assert torch.allclose(qt.scale, torch.tensor([[0.6 / 255]]))
    assert (dequantize(qt) - w).abs().max() <= qt.scale.max() / 2 + 1e-7


@pytest.mark.parametrize("sym", [False, True])
def test_quantize_constant_and_zero_blocks(sym: bool) -> None:
    w = torch.zeros(3, 64)
    w[1] = 0.3
    w[2, :32] = -1.25
    qt = quantize_rtn(w, 4, 32, sym)
    out = dequantize(qt)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0], torch.zeros(64))
    if not sym:  # a constant block decodes to its value rounded to fp16
        assert torch.equal(out[1], torch.full((64,), 0.3).half().float())
        assert torch.equal(out[2, :32], torch.full((32,), -1.25))


def test_quantize_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        quantize_rtn(torch.randn(4, 64), 5, 32)
    with pytest.raises(ValueError):
        quantize_rtn(torch.randn(4, 60), 4, 32)
    with pytest.raises(ValueError):
        quantize_rtn(torch.tensor([[float("nan"), 1.0]]), 4, 2)
    with pytest.raises(ValueError, match="overflows"):
        quantize_rtn(torch.tensor([[1e6, 1e6 + 1.0]]), 8, 2)  # zero overflows fp16


def test_quantize_symmetric_uses_exporter_scale() -> None:
    w = torch.tensor([[0.0, 1.0, -1.0, 127.0, -127.0, 2.0, 3.0, 0.4]])
    qt = quantize_rtn(w, 8, 8, True)
    assert torch.equal(qt.scale, torch.tensor([[1.0]]))
    assert qt.q.flatten().tolist() == [0, 1, -1, 127, -127, 2, 3, 0]


def test_quantize_keeps_half_inputs_and_device() -> None:
    w = torch.randn(4, 64).half()
    qt = quantize_rtn(w, 4, 32)
    assert qt.q.device == w.device and qt.scale.dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_quantize_on_cuda_matches_cpu() -> None:
    w = torch.randn(64, 256)
    cpu = quantize_rtn(w, 4, 64)
    gpu = quantize_rtn(w.cuda(), 4, 64)
    assert gpu.q.is_cuda
    assert torch.equal(gpu.q.cpu(), cpu.q) and torch.equal(gpu.scale.cpu(), cpu.scale)
    assert torch.equal(dequantize(gpu).cpu(), dequantize(cpu))
