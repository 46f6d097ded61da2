"""Carry the converter's external constants into the rebuilt weight file.

With ``--saveExternalData`` MNN's converter (3.6.1 tools/converter/source/common/RemoveParams.cpp,
``RemoveAndStoreParam``) moves every ``Blob`` constant of more than 1024 elements, every
convolution's weights, and LayerNorm/Scale parameters into ``{model}.mnn.weight``; the op keeps
``external = [offset, size, size, ...]`` (consecutive bytes starting at offset). The rebuilt
graph gets a new weight file holding the linear records, so those payloads must be copied into
it and their offsets moved, or the runtime reads linear records as, e.g., a norm's gamma (any
hidden size above 1024, a vision tower's position table, an audio tower's convolutions).
The converter folds RMSNorms into ``LayerNorm`` ops (gamma plus a zero beta) and moves their
parameters out at any size; those of up to 1024 elements go back into the op instead, where the
unfolded norm kept its gamma, so the weight file holds what the export plan counts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, BinaryIO, Iterable

import numpy as np

_CHUNK = 1 << 24
# Blob constants up to this many elements stay inside the graph (RemoveParams' own threshold).
_INLINE_ELEMENTS = 1024


def rehome_external(graph: dict[str, Any], source: Path, weight_file: BinaryIO, skip: Iterable[str] = ()) -> int:
    """Append the payload of every top-level op with an ``external`` field (except the ``skip``
    names: the linear records already written) from ``source`` to ``weight_file``; returns the
    bytes copied. Subgraphs (MoE expert templates) were converted from their own files and only
    hold linears and activations, so they are left alone."""
    skip = set(skip)
    moved = 0
    with open(source, "rb") if source.exists() else _empty() as src:
        for op in graph.get("oplists", []):
            main = op.get("main")
            if not isinstance(main, dict) or not main.get("external") or op.get("name") in skip:
                continue
            offset, sizes = int(main["external"][0]), [int(v) for v in main["external"][1:]]
            total = sum(sizes)
            if src is None or total == 0:
                if total:
                    raise ValueError(f"op {op.get('name')!r} refers to {source}, which does not exist")
                continue
            if op.get("type") == "LayerNorm" and max(sizes) <= 4 * _INLINE_ELEMENTS:
                _inline_layer_norm(main, src, offset, sizes)
                continue
            new_offset = weight_file.tell()
            src.seek(offset)
            left = total
            while left:
                data = src.read(min(left, _CHUNK))
                if not data:
                    raise ValueError(f"{source} ends before the payload of op {op.get('name')!r}")
                weight_file.write(data)
                left -= len(data)
            main["external"] = [new_offset, *sizes]
            moved += total
    return moved


def _inline_layer_norm(main: dict[str, Any], src: BinaryIO, offset: int, sizes: list[int]) -> None:
    """Put a small folded RMSNorm's gamma (and zero beta) back into the op, as the unfolded
    norm's constants were: the converter moves LayerNorm parameters out whatever their size."""
    src.seek(offset)
    for key, size in zip(("gamma", "beta"), sizes):
        data = src.read(size)
        if len(data) != size:
            raise ValueError(f"the converter's weight file ends inside a LayerNorm {key}")
        main[key] = np.frombuffer(data, dtype="<f4").astype(float).tolist()
    del main["external"]


class _empty:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
