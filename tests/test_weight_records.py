"""Linear weight records and embedding tables: golden bytes and writer -> reader round trips."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmexport.mnn.embeddings import read_embedding_table, table_size, write_embedding_table
from llmexport.mnn.weight_reader import read_linear
from llmexport.mnn.weights import LinearRecord, WeightFileWriter, record_size, value_map
from llmexport.quant.rtn import dequantize, quantize_rtn
from llmexport.quant.scheme import QuantScheme
from llmexport.spec import QuantizedTensor

BITS = (2, 3, 4, 8)
BLOCKS = (0, 32, 64, 128, 256)
MAP_4BIT = bytes([16]) + bytes(range(0xF8, 0x100)) + bytes(range(0, 8))  # 16, then -8..7


def _write(weight, bias, scheme, quantizer=None) -> tuple[bytes, LinearRecord]:
    buf = io.BytesIO()
    record = WeightFileWriter(buf).write_linear(weight, bias, scheme, quantizer)
    return buf.getvalue(), record


# ---------------------------------------------------------------- golden bytes

def test_golden_4bit_asym_record_with_bias() -> None:
    # Values chosen so scale/zero are exact in fp16: row 0 scale 1.5 zero 12, row 1 scale 1 zero 7.
    w = torch.tensor([[0, 1.5, 3, 4.5, 6, 7.5, 9, 22.5], [14, 13, 5, 4, -1, 0, 7.4, 2]])
    bias = torch.tensor([0.5, -2.0])
    data, rec = _write(w, bias, QuantScheme(bits=4, block=64))  # width 8 < 64: one block of 8
    expected = (
        bytes([0x02, 0x02, 0x00, 0x08, 0x00]) + MAP_4BIT
        # row 0 stored 0,1,2,3,4,5,6,15; row 1 stored 15,14,6,5,0,1,8,3
        + bytes([0x01, 0x23, 0x45, 0x6F, 0xFE, 0x65, 0x01, 0x83])
        # fp16 alpha [zero, scale] per row: 12.0, 1.5, 7.0, 1.0
        + bytes([0x00, 0x4A, 0x00, 0x3E, 0x00, 0x47, 0x00, 0x3C])
        # fp32 bias 0.5, -2.0
        + bytes([0x00, 0x00, 0x00, 0x3F, 0x00, 0x00, 0x00, 0xC0])
    )
    assert data == expected and rec.block == 8
    assert rec.external() == [0, 22 + 8, 8, 8, 0]
    assert rec.header_bytes == 22 and rec.weight_offset == 22 and rec.alpha_offset == 30
    assert rec.quan_parameter() == {
        "quantScale": 1.0, "scaleIn": 0.0, "scaleOut": 0.0, "useInt32": False,
        "has_scaleInt": False, "shapeInt32": False, "type": 1, "aMaxOrBits": 4, "aMin": 1,
        "readType": 2, "weightSize": 0, "scaleStorage": "FP16",
    }
    weight, read_bias = read_linear(data, rec.external(), rec.quan_parameter(), 2, 8)
    assert weight.tolist() == [[0, 1.5, 3, 4.5, 6, 7.5, 9, 22.5], [14, 13, 5, 4, -1, 0, 7, 2]]
    assert read_bias.tolist() == [0.5, -2.0]


def test_golden_8bit_sym_record() -> None:
    w = torch.tensor([[0.0, 1.0, -1.0, 127.0, -127.0, 2.0, 3.0, 0.4]])
    data, rec = _write(w, None, QuantScheme(bits=8, block=0, sym=True))
    expected = (
        bytes([0x02, 0x01, 0x00, 0x08, 0x00, 0x00])  # dims, then count byte 0 = 256 levels
        + bytes(range(0x80, 0x100)) + bytes(range(0, 0x80))  # -128..127
        + bytes([0x80, 0x81, 0x7F, 0xFF, 0x01, 0x82, 0x83, 0x80])  # q + 128
        + bytes([0x00, 0x3C])  # scale 1.0 in fp16, no zero
    )
    assert data == expected
    assert rec.external() == [0, 6 + 256 + 8, 2, 0, 0]
    qp = rec.quan_parameter()
    assert (qp["aMin"], qp["readType"], qp["aMaxOrBits"]) == (0, 0, 8)
    weight, bias = read_linear(data, rec.external(), qp, 1, 8)
    assert weight.tolist() == [[0, 1, -1, 127, -127, 2, 3, 0]] and bias is None


@pytest.mark.parametrize(
    "bits, expected",
    [(2, [4, -2, -1, 0, 1]), (3, [8, -4, -3, -2, -1, 0, 1, 2, 3]), (4, [16] + list(range(-8, 8)))],
)
def test_value_map(bits: int, expected: list[int]) -> None:
    assert value_map(bits) == np.array(expected, dtype=np.int8).tobytes()
    assert value_map(8)[0] == 0 and len(value_map(8)) == 257


def test_fp16_record() -> None:
    torch.manual_seed(0)
    w, b = torch.randn(5, 24), torch.randn(5)
    data, rec = _write(w, b, QuantScheme(bits=16))
    assert rec.quan_parameter() == {"type": 3}
    assert rec.external() == [0, 5 * 24 * 2, 0, 20, 0] and rec.header_bytes == 0
    assert data[:8] == w.half().numpy().tobytes()[:8]
    weight, bias = read_linear(data, rec.external(), rec.quan_parameter(), 5, 24)
    assert torch.equal(weight, w.half().float()) and torch.equal(bias, b)


# ---------------------------------------------------------------- round trips

@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("ic", [256, 96])
def test_writer_reader_matches_dequantize(bits: int, block: int, sym: bool, ic: int) -> None:
    torch.manual_seed(bits + block + ic)
    oc = 7
    w, b = torch.randn(oc, ic) * 0.02, torch.randn(oc)
    scheme = QuantScheme(bits=bits, block=block, sym=sym)
    data, rec = _write(w, b, scheme)
    used = scheme.block_for(ic)
    assert rec.block == used and len(data) == rec.total_bytes
    qp = rec.quan_parameter()
    if sym:
        assert qp["readType"] == 0 and qp["aMin"] == 0
    else:
        assert qp["readType"] == oc * (ic // used) > 0 and qp["aMin"] == 1
    assert rec.alpha_bytes == oc * (ic // used) * (1 if sym else 2) * 2
    assert rec.weight_bytes == rec.header_bytes + (oc * ic * bits + 7) // 8
    weight, bias = read_linear(data, rec.external(), qp, oc, ic)
    assert torch.equal(weight, dequantize(quantize_rtn(w, bits, used, sym)))
    assert torch.equal(bias, b)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("chunk", [1, 7, 96, 1000])
def test_decoding_in_chunks_of_groups_changes_nothing(monkeypatch, bits: int, chunk: int) -> None:
    """The reader decodes a record a few groups at a time (a 262,144-row lm_head whole would take
    10 GiB of bit columns): every chunking gives the values of one pass, for odd group sizes too."""
    import llmexport.mnn.weight_reader as reader

    torch.manual_seed(bits * chunk)
    oc, ic = 9, 96
    for block, sym in ((32, False), (64, True), (0, False)):  # 64 into 96 columns: the block is narrowed
        data, rec = _write(torch.randn(oc, ic), None, QuantScheme(bits=bits, block=block, sym=sym))
        whole, _ = read_linear(data, rec.external(), rec.quan_parameter(), oc, ic)
        monkeypatch.setattr(reader, "_CHUNK_VALUES", chunk)
        chunked, _ = read_linear(data, rec.external(), rec.quan_parameter(), oc, ic)
        monkeypatch.undo()
        assert torch.equal(chunked, whole)


def test_records_follow_each_other_in_one_file(tmp_path) -> None:
    path = tmp_path / "llm.mnn.weight"
    torch.manual_seed(1)
    layers = [(torch.randn(16, 48), None, QuantScheme(4, 64)),  # narrower than the block
              (torch.randn(8, 96), torch.randn(8), QuantScheme(3, 64, sym=True)),
              (torch.randn(4, 32), torch.randn(4), QuantScheme(16)),
              (torch.randn(6, 64), None, QuantScheme(2, 0))]
    with open(path, "wb") as f:
        f.write(b"\x00" * 3)  # something already in the file
        writer = WeightFileWriter(f)
        records = [writer.write_linear(w, b, s) for w, b, s in layers]
    assert records[0].offset == 3 and records[0].block == 48 and records[0].quan_parameter()["readType"] == 16
    for prev, rec in zip(records, records[1:]):
        assert rec.offset == prev.offset + prev.total_bytes
    assert path.stat().st_size == writer.offset
    for (w, b, s), rec in zip(layers, records):
        weight, bias = read_linear(path, rec.external(), rec.quan_parameter(), rec.oc, rec.ic)
        expected = w.half().float() if s.is_fp16 else dequantize(quantize_rtn(w, s.bits, rec.block, s.sym))
        assert torch.equal(weight, expected)
        assert (bias is None) == (b is None) and (b is None or torch.equal(bias, b))


@pytest.mark.parametrize("bits", BITS)
def test_row_chunking_does_not_change_bytes(monkeypatch, bits: int) -> None:
    import llmexport.mnn.weights as weights_module

    torch.manual_seed(bits)
    w, b = torch.randn(37, 40), torch.randn(37)
    whole, _ = _write(w, b, QuantScheme(bits, 32))
    monkeypatch.setattr(weights_module, "_CHUNK_ELEMENTS", 100)  # 8 rows per chunk
    chunked, rec = _write(w, b, QuantScheme(bits, 32))
    assert chunked == whole and rec.block == 8


def test_int32_shape_header_for_wide_outputs() -> None:
    oc, ic = 65537, 8
    w = torch.linspace(-1, 1, oc * ic).reshape(oc, ic)
    data, rec = _write(w, None, QuantScheme(bits=8, block=0))
    assert data[:9] == b"\x02" + struct.pack("<II", oc, ic)
    assert rec.header_bytes == 1 + 8 + 1 + 256 and rec.quan_parameter()["shapeInt32"] is True
    weight, _ = read_linear(data, rec.external(), rec.quan_parameter(), oc, ic)
    assert torch.equal(weight, dequantize(quantize_rtn(w, 8, ic, False)))


def test_uint16_shape_header_above_int16_range() -> None:
    w = torch.randn(40000, 2)
    data, rec = _write(w, None, QuantScheme(bits=8, block=0))
    assert data[:5] == b"\x02" + struct.pack("<HH", 40000, 2) and not rec.shape_int32


# ---------------------------------------------------------------- quantizer plug-in and strictness

def test_custom_quantizer_is_used_and_checked() -> None:
    w = torch.randn(4, 64)
    calls = []

    def spy(weight, bits, block, sym):
        calls.append((bits, block, sym))
        return quantize_rtn(weight, bits, block, sym)

    data, rec = _write(w, None, QuantScheme(4, 32), spy)
    assert calls == [(4, 32, False)]

    def wrong_shape(weight, bits, block, sym):
        return quantize_rtn(weight, bits, block * 2, sym)

    def wrong_kind(weight, bits, block, sym):
        return quantize_rtn(weight, bits, block, not sym)

    def unstorable(weight, bits, block, sym):
        qt = quantize_rtn(weight, bits, block, sym, scale_dtype=torch.float32)
        return QuantizedTensor(qt.q, qt.scale + 1e-9, qt.zero, bits, block)

    for bad in (wrong_shape, wrong_kind, unstorable):
        with pytest.raises(ValueError):
            _write(w, None, QuantScheme(4, 32), bad)


def test_strict_reader_rejects_bad_flags() -> None:
    w = torch.randn(4, 64)
    data, rec = _write(w, None, QuantScheme(4, 32))
    for key, value in (("aMin", 0), ("readType", 4), ("scaleIn", 1.0), ("quantScale", 2.0)):
        qp = dict(rec.quan_parameter(), **{key: value})
        with pytest.raises(ValueError):
            read_linear(data, rec.external(), qp, 4, 64)
    # Non-strict decodes like the runtime: aMin 0 shifts every zero by 128 * scale.
    qp = dict(rec.quan_parameter(), aMin=0)
    shifted, _ = read_linear(data, rec.external(), qp, 4, 64, strict=False)
    assert not torch.allclose(shifted, read_linear(data, rec.external(), rec.quan_parameter(), 4, 64)[0])


def test_bad_scheme_and_shapes_rejected() -> None:
    with pytest.raises(ValueError):
        _write(torch.randn(4, 64), None, QuantScheme(5, 32))
    with pytest.raises(ValueError):
        _write(torch.randn(4, 64), torch.randn(3), QuantScheme(4, 32))
    with pytest.raises(ValueError):
        _write(torch.randn(64), None, QuantScheme(4, 32))


# ---------------------------------------------------------------- embeddings

def _disk_embedding_expected(qt: QuantizedTensor) -> torch.Tensor:
    """DiskEmbedding's formula: stored * scale + (zero - 2^(b-1) * scale), fp32."""
    shift = float(-(1 << (qt.bits - 1)))
    folded = qt.zero + qt.scale * shift
    out = qt.stored().float() * qt.scale.unsqueeze(-1) + folded.unsqueeze(-1)
    return out.reshape(qt.shape)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [0, 32, 64])
def test_embedding_round_trip(tmp_path, bits: int, block: int) -> None:
    torch.manual_seed(bits + block)
    table = torch.randn(37, 128)
    path = tmp_path / "emb.bin"
    with open(path, "wb") as f:
        rec = write_embedding_table(f, table, bits, block)
    used = block or 128
    assert (rec.rows, rec.dim, rec.block) == (37, 128, used)
    assert rec.weight_bytes == 37 * 128 * bits // 8 and rec.alpha_bytes == 37 * (128 // used) * 2 * 4
    assert rec.ple_quant() == [0, rec.weight_bytes, rec.alpha_bytes, bits, used]
    decoded = read_embedding_table(path, 37, 128, bits, block)
    qt = quantize_rtn(table, bits, used, False, scale_dtype=torch.float32)
    assert torch.equal(decoded, _disk_embedding_expected(qt))
    assert torch.allclose(decoded, dequantize(qt), rtol=0, atol=1e-6)


def test_embedding_chunks_give_same_bytes() -> None:
    table = torch.randn(50, 64)
    whole, parts = io.BytesIO(), io.BytesIO()
    write_embedding_table(whole, table, 4, 32)
    rec = write_embedding_table(parts, iter(table.split(7)), 4, 32)
    assert whole.getvalue() == parts.getvalue() and rec.rows == 50


def test_embedding_bf16(tmp_path) -> None:
    table = torch.randn(9, 20)
    path = tmp_path / "ple_bf16.bin"
    with open(path, "wb") as f:
        rec = write_embedding_table(f, table, 16, 64)
    assert (rec.weight_bytes, rec.alpha_bytes) == (9 * 20 * 2, 0)
    assert torch.equal(read_embedding_table(path, 9, 20, 16, 0), table.bfloat16().float())


def test_embedding_golden_4bit() -> None:
    buf = io.BytesIO()
    write_embedding_table(buf, torch.tensor([[0, 1.5, 3, 22.5]]), 4, 0)
    # levels 0,1,2,15 then fp32 [zero 12.0, scale 1.5]
    assert buf.getvalue() == bytes([0x01, 0x2F]) + struct.pack("<ff", 12.0, 1.5)


@pytest.mark.parametrize("bits", [2, 3, 5])
def test_embedding_refuses_bits(bits: int) -> None:
    with pytest.raises(ValueError, match="bits"):
        write_embedding_table(io.BytesIO(), torch.randn(4, 64), bits, 32)


def test_embedding_refuses_non_dividing_block() -> None:
    with pytest.raises(ValueError, match=r"valid blocks: \[0, 32, 64\]"):
        write_embedding_table(io.BytesIO(), torch.randn(4, 192), 8, 128)
    with pytest.raises(ValueError):
        write_embedding_table(io.BytesIO(), torch.randn(4, 7), 4, 0)  # half a byte per row


def test_tied_lm_head_read_as_embedding(tmp_path) -> None:
    """tie_embeddings: the runtime reads the lm_head record's levels and fp16 alpha directly."""
    path = tmp_path / "llm.mnn.weight"
    w = torch.randn(33, 64)
    with open(path, "wb") as f:
        f.write(b"pad")
        rec = WeightFileWriter(f).write_linear(w, None, QuantScheme(4, 32))
    decoded = read_embedding_table(path, 33, 64, 4, 32, offset=rec.weight_offset,
                                   alpha_dtype=torch.float16, alpha_bytes=rec.alpha_bytes)
    assert rec.alpha_offset == rec.weight_offset + 33 * 64 // 2
    qt = quantize_rtn(w, 4, 32, False)
    assert torch.equal(decoded, _disk_embedding_expected(qt))


# ---------------------------------------------------------------- the real MNN 3.6.1 loader

_MNN_CHILD = r'''
import json, os, sys
import numpy as np
import _tools
import MNN.expr as F
import MNN.nn as nn

spec = json.load(open(sys.argv[1]))
work, oc, ic = spec["dir"], spec["oc"], spec["ic"]
x = F.placeholder([1, ic, 1, 1], F.NCHW)
x.name = "input"
w = F.const(np.zeros(oc * ic, np.float32).tolist(), [oc, ic, 1, 1])
b = F.const(np.zeros(oc, np.float32).tolist(), [oc])
y = F.convert(F.conv2d(F.convert(x, F.NC4HW4), w, b), F.NCHW)
y.name = "output"
F.save([y], f"{work}/base.mnn")
_tools.mnnconvert(["", "-f", "MNN", "--modelFile", f"{work}/base.mnn", "--JsonFile", f"{work}/base.json"])
graph = json.load(open(f"{work}/base.json"))
ops = []
for op in graph["oplists"]:
    if op["type"] == "Const":
        continue
    if op["type"] == "Convolution":
        op["inputIndexes"] = op["inputIndexes"][:1]
        op["main"] = {"common": op["main"]["common"], "quanParameter": spec["quanParameter"],
                      "external": spec["external"]}
    ops.append(op)
graph["oplists"] = ops
json.dump(graph, open(f"{work}/q.json", "w"))
_tools.mnnconvert(["", "-f", "JSON", "--modelFile", f"{work}/q.json", "--MNNModel", f"{work}/q.mnn"])
os.replace(spec["weight_path"], f"{work}/q.mnn.weight")
rt = nn.create_runtime_manager(({"backend": "CPU", "precision": "high", "numThread": 1},))
module = nn.load_module_from_file(f"{work}/q.mnn", ["input"], ["output"], runtime_manager=rt)
out = module.forward([F.const(spec["x"], [1, ic, 1, 1])])[0]
json.dump(np.array(out.read()).reshape(-1).tolist(), open(f"{work}/out.json", "w"))
sys.stdout.flush()
os._exit(0)
'''


def _run_in_mnn(tmp_path, record: LinearRecord, weight_path, x: torch.Tensor) -> torch.Tensor:
    import json
    import subprocess
    import sys

    spec = {"dir": str(tmp_path), "oc": record.oc, "ic": record.ic, "x": x.tolist(),
            "quanParameter": record.quan_parameter(), "external": record.external(),
            "weight_path": str(weight_path)}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "child.py").write_text(_MNN_CHILD)
    proc = subprocess.run([sys.executable, str(tmp_path / "child.py"), str(tmp_path / "spec.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return torch.tensor(json.loads((tmp_path / "out.json").read_text()))


@pytest.mark.parametrize(
    "oc, ic, scheme",
    [(16, 96, QuantScheme(4, 64)), (16, 64, QuantScheme(3, 32, sym=True)), (24, 40, QuantScheme(2, 32)),
     (16, 48, QuantScheme(8, 64, sym=True)), (8, 64, QuantScheme(16))],
    ids=["4bit-asym-96@64", "3bit-sym", "2bit-asym-40@32", "8bit-sym-narrow", "fp16"],
)
def test_mnn_runtime_decodes_records(tmp_path, oc: int, ic: int, scheme: QuantScheme) -> None:
    """MNN 3.6.1 itself runs a 1x1 convolution over our record: x @ dequantize(w).T + b."""
    torch.manual_seed(oc + ic)
    w, b, x = torch.randn(oc, ic) * 0.1, torch.randn(oc), torch.randn(ic)
    weight_path = tmp_path / "record.bin"
    with open(weight_path, "wb") as f:
        record = WeightFileWriter(f).write_linear(w, b, scheme)
    got = _run_in_mnn(tmp_path, record, weight_path, x)
    stored_w = (w.half().float() if scheme.is_fp16
                else dequantize(quantize_rtn(w, scheme.bits, record.block, scheme.sym)))
    expected = stored_w.double() @ x.double() + b.double()
    assert (got.double() - expected).abs().max() < 1e-4


@settings(max_examples=60, deadline=None)
@given(oc=st.integers(1, 40), ic=st.sampled_from([8, 16, 24, 48, 64, 96, 100, 128, 256]),
       bits=st.sampled_from([2, 3, 4, 8, 16]), block=st.sampled_from([0, 32, 64, 128, 256]), sym=st.booleans(),
       bias=st.booleans())
def test_record_size_is_what_the_writer_writes(oc, ic, bits, block, sym, bias) -> None:
    """The plan's record sizes (``record_size``) are the writer's bytes, for any shape and scheme."""
    generator = torch.Generator().manual_seed(oc * 1000 + ic)
    weight = torch.randn(oc, ic, generator=generator)
    scheme = QuantScheme(bits, block, sym)
    data, record = _write(weight, torch.randn(oc, generator=generator) if bias else None, scheme)
    assert record_size(oc, ic, scheme, bias) == len(data) == record.total_bytes


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 30), dim=st.sampled_from([8, 16, 32, 64, 96, 128, 256]),
       bits=st.sampled_from([4, 8, 16]), block=st.sampled_from([0, 32, 64, 128]))
def test_table_size_is_what_the_table_writer_writes(rows, dim, bits, block) -> None:
    if bits != 16 and block and dim % block:
        return  # refused by the writer (test_bad_scheme_and_shapes_rejected and the export's checks)
    table = torch.randn(rows, dim, generator=torch.Generator().manual_seed(rows * 100 + dim))
    out = io.BytesIO()
    write_embedding_table(out, table, bits, block)
    assert table_size(rows, dim, bits, block) == len(out.getvalue())
