"""GGUF blocks kept as MNN records (llmexport.source.importers.gguf.blocks): on random blocks of every
kept type, the integers decode to exactly what gguf-py's reference (``gguf.quants.dequantize``)
gives, and the MNN record written from them (``QuantMethod.STORED``) reads back to the same values
(llmexport.mnn.weight_reader, the read-back oracle of verification)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from llmexport.mnn.weight_reader import read_linear
from llmexport.mnn.weights import WeightFileWriter
from llmexport.quant.scheme import QuantMethod, QuantScheme
from llmexport.source.importers.gguf.blocks import KEPT, prequantized

#: byte offsets of each type's fp16 fields in a block (the rest is levels and packed scales)
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2),
              "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,)}


def random_blocks(kind: str, rows: int, blocks: int, seed: int) -> np.ndarray:
    """``[rows, blocks * bytes]`` of random bytes whose fp16 fields hold finite values of either sign
    between 2^-14 and 2^2 (any other bytes are valid levels and scales)."""
    rng = np.random.default_rng(seed)
    size = KEPT[kind].block_bytes
    raw = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    for at in F16_FIELDS[kind]:
        values = (rng.choice([-1.0, 1.0], (rows, blocks)) * 2.0 ** rng.uniform(-14, 2, (rows, blocks)))
        raw[..., at:at + 2] = values.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, blocks * size)


def _reference(kind: str, raw: np.ndarray) -> np.ndarray:
    return dequantize(raw, GGMLQuantizationType[kind]).astype(np.float32)


@pytest.mark.parametrize("kind", sorted(KEPT))
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 6), blocks=st.integers(1, 3))
def test_kept_blocks_decode_exactly_as_gguf_dequantizes(kind, seed, rows, blocks):
    raw = random_blocks(kind, rows, blocks, seed)
    pq = prequantized(KEPT[kind], raw)
    assert pq.bits == KEPT[kind].bits and pq.group == KEPT[kind].group
    assert pq.levels.shape == (rows, blocks * KEPT[kind].block_values) and int(pq.levels.max()) < 1 << pq.bits
    assert np.array_equal(pq.dequantize().numpy(), _reference(kind, raw))
    assert pq.symmetric == KEPT[kind].sym  # a symmetric type is MNN's scales-only record


@pytest.mark.parametrize("kind", sorted(KEPT))
def test_kept_record_reads_back_as_gguf_dequantizes(tmp_path, kind):
    """Written as MNN records and read back as the runtime decodes them: gguf-py's values, exactly,
    for blocks llama.cpp's quantizer makes (the Python reference where gguf-py has one; random
    blocks whose min lies within the scale's binades for the K-quants)."""
    rows, cols = 16, 512
    weights = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    qtype = GGMLQuantizationType[kind]
    try:
        raw = quantize(weights, qtype)
    except NotImplementedError:  # K-quants: no Python quantizer in gguf-py
        raw = random_blocks(kind, rows, cols // 256, 1)
        if not KEPT[kind].sym:
            at, min_at = F16_FIELDS[kind]
            d = raw.reshape(rows, -1, KEPT[kind].block_bytes)
            d[..., min_at:min_at + 2] = d[..., at:at + 2]  # dmin = d: zero = 2^(bits-1) d sc - d m is exact
    pq = prequantized(KEPT[kind], raw)
    info = KEPT[kind].info
    path = tmp_path / "w.bin"
    with open(path, "wb") as f:
        record = WeightFileWriter(f, 0).write_linear(pq, None, QuantScheme(info.bits, info.group, info.sym,
                                                                            QuantMethod.STORED))
    decoded, _ = read_linear(path, record.external(), record.quan_parameter(), rows, cols)
    assert torch.equal(decoded, torch.from_numpy(_reference(kind, raw)))
    changed = raw.copy()
    changed[0, -1] ^= 0x11  # one level of the last block: the decode follows the bytes
    assert not np.array_equal(_reference(kind, changed), _reference(kind, raw))
    assert not torch.equal(prequantized(KEPT[kind], changed).dequantize(), decoded)
