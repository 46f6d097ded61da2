"""Exact float values for a graph that goes through MNN's JSON form.

The converter's JSON dump (``-f MNN --JsonFile``, flatbuffers' mini-reflection text printer) writes
every float with six decimals: a RoPE inverse frequency 0.56234133 comes back as 0.562341, an
attention scale 1/sqrt(128) as 0.088388, a bf16 norm gamma 1.1796875 as 1.179688, and an inverse
frequency below 5e-7 as 0. Everything the export writes goes through that JSON (the placeholders are
replaced there), so each float read from the dump is replaced by the value stored in the binary
``.mnn`` it was dumped from. ``json.dumps`` then writes the shortest decimal that parses back to
the same float64, which is the float32 itself, so the JSON -> MNN step stores it unchanged.

The binary is read with a small flatbuffers reader over the subset of MNN's schema that carries
floats (field slots of ``schema/default/*.fbs`` in MNN 3.6.1). A float in a table this subset does
not describe is an error rather than a silently rounded value.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any

import numpy as np

from llmexport.errors import ConversionError

F32, F32S = "f32", "[f32]"

# table -> {JSON key: (field slot, kind)}; kind is F32, F32S, a table name or [table name].
# Slots are field positions in the 3.6.1 schema (a union field takes two: type, then value).
SCHEMA: dict[str, dict[str, tuple[int, str]]] = {
    "Net": {"extraTensorDescribe": (1, "[TensorDescribe]"), "oplists": (3, "[Op]"),
            "subgraphs": (10, "[SubGraphProto]")},
    "SubGraphProto": {"nodes": (4, "[Op]"), "extraTensorDescribe": (5, "[TensorDescribe]")},
    "TensorDescribe": {"blob": (0, "Blob"), "quantInfo": (4, "TensorQuantInfo")},
    "TensorQuantInfo": {"scale": (0, F32), "zero": (1, F32), "min": (2, F32), "max": (3, F32)},
    "Blob": {"float32s": (7, F32S)},
    "Extra": {"attr": (3, "[Attribute]")},
    "Attribute": {"f": (5, F32), "tensor": (6, "Blob"), "list": (7, "ListValue")},
    "ListValue": {"f": (2, F32S)},
    "Relu": {"slope": (0, F32)},
    "Relu6": {"minValue": (0, F32), "maxValue": (1, F32)},
    "ELU": {"alpha": (0, F32)},
    "Selu": {"scale": (0, F32), "alpha": (1, F32)},
    "PRelu": {"slope": (1, F32S)},
    "Eltwise": {"coeff": (1, F32S)},
    "Scale": {"scaleData": (1, F32S), "biasData": (2, F32S)},
    "ReductionParam": {"coeff": (2, F32)},
    "LayerNorm": {"epsilon": (1, F32), "gamma": (2, F32S), "beta": (3, F32S)},
    "AttentionParam": {"mhq_quant": (4, "[TensorQuantInfo]"), "attnScale": (6, F32)},
    "RoPEParam": {"q_norm": (4, "LayerNorm"), "k_norm": (5, "LayerNorm")},
    "Convolution2D": {"weight": (1, F32S), "bias": (2, F32S), "quanParameter": (3, "IDSTQuan"),
                      "symmetricQuan": (4, "QuantizedFloatParam")},
    "IDSTQuan": {"alpha": (1, F32S), "quantScale": (4, F32), "scaleIn": (5, F32), "scaleOut": (6, F32)},
    "QuantizedFloatParam": {"scale": (2, F32S), "tensorScale": (3, F32S)},
    "Interp": {"widthScale": (0, F32), "heightScale": (1, F32), "widthOffset": (7, F32),
               "heightOffset": (8, F32), "cubicCoeffA": (9, F32)},
}
OP_MAIN_SLOT = 2  # Op.main (Op.main_type is slot 1)


class _Table:
    """One flatbuffers table: ``pos`` is its absolute offset in ``buf``."""

    def __init__(self, buf: bytes, pos: int):
        self.buf, self.pos = buf, pos

    def _field(self, slot: int) -> int | None:
        vtable = self.pos - struct.unpack_from("<i", self.buf, self.pos)[0]
        vtable_size = struct.unpack_from("<H", self.buf, vtable)[0]
        entry = 4 + 2 * slot
        if entry >= vtable_size:
            return None
        offset = struct.unpack_from("<H", self.buf, vtable + entry)[0]
        return self.pos + offset if offset else None

    def _deref(self, at: int) -> int:
        return at + struct.unpack_from("<I", self.buf, at)[0]

    def f32(self, slot: int) -> float | None:
        at = self._field(slot)
        return None if at is None else struct.unpack_from("<f", self.buf, at)[0]

    def f32s(self, slot: int) -> np.ndarray | None:
        at = self._field(slot)
        if at is None:
            return None
        start = self._deref(at)
        count = struct.unpack_from("<I", self.buf, start)[0]
        return np.frombuffer(self.buf, dtype="<f4", count=count, offset=start + 4)

    def table(self, slot: int) -> _Table | None:
        at = self._field(slot)
        return None if at is None else _Table(self.buf, self._deref(at))

    def tables(self, slot: int) -> list[_Table]:
        at = self._field(slot)
        if at is None:
            return []
        start = self._deref(at)
        count = struct.unpack_from("<I", self.buf, start)[0]
        return [_Table(self.buf, self._deref(start + 4 + 4 * i)) for i in range(count)]


def _has_float(value: Any) -> bool:
    if isinstance(value, float):
        return True
    if isinstance(value, dict):
        return any(_has_float(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_float(v) for v in value)
    return False


def _check(printed: Any, exact: float, where: str) -> float:
    """The dump printed ``exact`` rounded to six decimals; anything else means a misread slot."""
    if not math.isfinite(exact) or abs(float(printed) - exact) > 1e-6 * max(1.0, abs(exact)):
        raise ConversionError(f"{where}: the graph's binary holds {exact!r} where its JSON dump says "
                              f"{printed!r}; MNN's schema changed (llmexport/mnn/exact_floats.py)")
    return float(exact)


def _restore_field(obj: dict, key: str, table: _Table, slot: int, kind: str, where: str) -> None:
    value = obj[key]
    if kind == F32:
        exact = table.f32(slot)
        if exact is not None:
            obj[key] = _check(value, exact, where)
    elif kind == F32S:
        exacts = table.f32s(slot)
        if exacts is None or len(exacts) != len(value):
            raise ConversionError(f"{where}: {len(value)} floats in the JSON dump, "
                                  f"{None if exacts is None else len(exacts)} in the binary")
        obj[key] = [_check(v, float(e), f"{where}[{i}]") for i, (v, e) in enumerate(zip(value, exacts))]
    elif kind.startswith("["):
        items = table.tables(slot)
        if len(items) != len(value):
            raise ConversionError(f"{where}: {len(value)} entries in the JSON dump, {len(items)} in the binary")
        for i, (item, sub) in enumerate(zip(value, items)):
            _restore_table(item, sub, kind[1:-1], f"{where}[{i}]")
    else:
        child = table.table(slot)
        if child is None:
            raise ConversionError(f"{where}: in the JSON dump but not in the binary")
        _restore_table(value, child, kind, where)


def _restore_table(obj: dict, table: _Table, name: str, where: str) -> None:
    if name == "Op":
        _restore_op(obj, table, where)
        return
    fields = SCHEMA.get(name, {})
    for key, value in obj.items():
        if key in fields:
            _restore_field(obj, key, table, *fields[key], f"{where}.{key}")
        elif _has_float(value):
            raise ConversionError(f"{where}.{key}: a float field of MNN table {name} that "
                                  "llmexport/mnn/exact_floats.py does not know; it would be rounded")


def _restore_op(op: dict, table: _Table, where: str) -> None:
    main = op.get("main")
    if not isinstance(main, dict) or not _has_float(main):
        return
    where = f"op {op.get('name')!r} ({op.get('main_type')})"
    sub = table.table(OP_MAIN_SLOT)
    if sub is None:
        raise ConversionError(f"{where}: parameters in the JSON dump but not in the binary")
    _restore_table(main, sub, str(op.get("main_type")), where)


def restore_exact_floats(graph: dict[str, Any], mnn_path: Path) -> dict[str, Any]:
    """Replace every float of ``graph`` (the JSON dump of ``mnn_path``) with the binary's value."""
    buf = mnn_path.read_bytes()
    _restore_table(graph, _Table(buf, struct.unpack_from("<I", buf, 0)[0]), "Net", str(mnn_path.name))
    return graph

