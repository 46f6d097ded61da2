"""The fast quantization path computes exactly what the plain whole-tensor arithmetic computes:
tiling, worker threads and the packing shortcut change speed, never a byte."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import llmexport.quant.rtn as rtn
import llmexport.quant.workers as workers
from llmexport.mnn.embeddings import read_embedding_table, write_embedding_table
from llmexport.mnn.weights import WeightFileWriter
from llmexport.quant.pack import pack_bits
from llmexport.quant.scheme import QuantScheme


def _plain_rtn(w: torch.Tensor, bits: int, block: int, sym: bool, scale_dtype: torch.dtype):
    """The arithmetic of quantize_rtn on the whole tensor at once (independent reference)."""
    oc, ic = w.shape
    offset = 1 << (bits - 1)
    wb = w.float().reshape(oc, ic // block, block)
    lo, hi = wb.amin(-1), wb.amax(-1)
    if sym:
        scale = (torch.maximum(hi, -lo) / (offset - 1)).to(scale_dtype).float()
        zero = None
        levels = wb
    else:
        scale = ((hi - lo) / (2 * offset - 1)).to(scale_dtype).float()
        zero = (lo + offset * scale).to(scale_dtype).float()
        levels = wb - zero.unsqueeze(-1)
    flat = scale == 0
    levels = (levels * (1.0 / torch.where(flat, torch.ones_like(scale), scale)).unsqueeze(-1)).round()
    levels = levels.masked_fill(flat.unsqueeze(-1), 0.0)
    return levels.clamp(-offset, offset - 1).to(torch.int8), scale, zero


@settings(max_examples=60, deadline=None)
@given(oc=st.integers(1, 40), nblocks=st.integers(1, 5), block=st.sampled_from([8, 32, 64]),
       bits=st.sampled_from([2, 3, 4, 8]), sym=st.booleans(), tile=st.integers(1, 600),
       fp32=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       seed=st.integers(0, 2**16))
def test_tiled_rtn_equals_whole_tensor_arithmetic(oc, nblocks, block, bits, sym, tile, fp32, dtype, seed):
    w = (torch.randn(oc, nblocks * block, generator=torch.Generator().manual_seed(seed)) * 0.05).to(dtype)
    w[0, :block] = 0.25  # a constant block: scale 0
    scale_dtype = torch.float32 if fp32 else torch.float16
    q, scale, zero = _plain_rtn(w, bits, block, sym, scale_dtype)
    old = rtn._TILE_ELEMENTS
    rtn._TILE_ELEMENTS = tile
    try:
        got = rtn.quantize_rtn(w, bits, block, sym, scale_dtype)
    finally:
        rtn._TILE_ELEMENTS = old
    assert torch.equal(got.q, q) and torch.equal(got.scale, scale)
    assert (got.zero is None) == sym and (sym or torch.equal(got.zero, zero))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_tiled_rtn_still_rejects_nan_in_any_tile(bad):
    w = torch.randn(64, 64)
    w[57, 3] = bad
    old = rtn._TILE_ELEMENTS
    rtn._TILE_ELEMENTS = 128  # two rows per tile: the bad value sits in a late tile
    try:
        with pytest.raises(ValueError, match="NaN or Inf"):
            rtn.quantize_rtn(w, 4, 32)
    finally:
        rtn._TILE_ELEMENTS = old


@settings(max_examples=40, deadline=None)
@given(values=st.lists(st.integers(0, 15), max_size=301))
def test_4bit_pairs_pack_high_nibble_first(values):
    expected = bytes((a << 4) | b for a, b in zip(values[0::2], (values + [0])[1::2]))
    assert pack_bits(np.array(values, dtype=np.uint8), 4) == expected


def test_map_ordered_keeps_order_bounds_work_and_runs_nested_calls_inline():
    seen_threads = set()

    def square(i):
        seen_threads.add(threading.current_thread().name)
        # a nested call from a worker runs inline (no deadlock waiting on its own pool)
        return i * i, list(workers.map_ordered(lambda j: j + 1, range(3)))

    out = list(workers.map_ordered(square, range(50), in_flight=3))
    assert [v for v, _ in out] == [i * i for i in range(50)] and all(n == [1, 2, 3] for _, n in out)
    if workers.worker_count() > 1:
        assert all(name.startswith("llmexport-quant") for name in seen_threads)
        assert torch.get_num_threads() >= 1  # the caller's own torch threads are left alone


def test_map_ordered_raises_the_workers_error():
    def fail(i):
        if i == 7:
            raise ValueError("slice 7")
        return i

    with pytest.raises(ValueError, match="slice 7"):
        list(workers.map_ordered(fail, range(20)))


@pytest.mark.parametrize("scheme", [QuantScheme(4, 64), QuantScheme(8, 32, sym=True), QuantScheme(3, 32),
                                    QuantScheme(2, 64)], ids=str)
def test_parallel_writer_bytes_equal_one_worker(monkeypatch, scheme):
    import llmexport.mnn.weights as weights_module

    torch.manual_seed(scheme.bits)
    w, b = torch.randn(203, 192).to(torch.bfloat16), torch.randn(203)

    def write():
        buf = io.BytesIO()
        WeightFileWriter(buf).write_linear(w, b, scheme)
        return buf.getvalue()

    monkeypatch.setattr(weights_module, "_CHUNK_ELEMENTS", 1000)  # many slices in flight
    parallel = write()
    monkeypatch.setattr(workers, "worker_count", lambda: 1)
    assert write() == parallel


@pytest.mark.parametrize("bits", [4, 8])
def test_parallel_table_bytes_equal_one_worker(monkeypatch, bits):
    import llmexport.mnn.embeddings as embeddings_module

    table = torch.randn(301, 128).to(torch.bfloat16)
    monkeypatch.setattr(embeddings_module, "_SLICE_ELEMENTS", 1000)

    def write():
        buf = io.BytesIO()
        write_embedding_table(buf, table, bits, 64)
        return buf.getvalue()

    parallel = write()
    monkeypatch.setattr(workers, "worker_count", lambda: 1)
    assert write() == parallel


@settings(max_examples=25, deadline=None)
@given(bits=st.sampled_from([16, 8, 4]), rows=st.integers(1, 40), start=st.integers(0, 40), span=st.integers(0, 40))
def test_table_row_range_is_a_slice_of_the_whole_table(tmp_path_factory, bits, rows, start, span):
    start = min(start, rows)
    stop = min(rows, start + span)
    path = tmp_path_factory.mktemp("table") / "t.bin"
    with open(path, "wb") as f:
        write_embedding_table(f, torch.randn(rows, 64), bits, 32)
    whole = read_embedding_table(path, rows, 64, bits, 32)
    assert torch.equal(read_embedding_table(path, rows, 64, bits, 32, row_range=(start, stop)), whole[start:stop])
