"""A GGUF file's tensors under HF names (the ``PrequantizedStore`` interface): dequantized on read
(gguf-py's ``gguf.quants.dequantize``, llama.cpp's numpy reference), q/k rows put back in HF's order,
stacked experts split into HF's per-expert tensors (or kept stacked where HF's are: Gemma4's, read
one expert at a time), and the blocks of the types an MNN record holds (``blocks.KEPT``) handed over
as their integers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from llmexport.errors import InputError
from llmexport.source.importers.gguf.blocks import KEPT, prequantized
from llmexport.source.importers.gguf.config import ARCHITECTURES
from llmexport.source.importers.gguf.file import GgufFile, GgufTensor
from llmexport.source.importers.gguf.names import (
    NOT_TENSORS,
    expert_names,
    hf_name,
    permuted_heads,
    unpermute_order,
    unsqueezed_axis,
)
from llmexport.source.safetensors_file import WholeLazy
from llmexport.spec import Prequantized, QuantInfo

#: the float types, which the export quantizes by its options
FLOAT_TYPES = ("F32", "F16", "BF16")


def unkept_reason(kind: str) -> str:
    """Why a tensor of this GGUF type does not keep its integers."""
    if kind in FLOAT_TYPES:
        return f"{kind} in the GGUF file: quantized by the export's options"
    if kind.startswith("IQ") or kind in ("TQ1_0", "TQ2_0", "MXFP4", "NVFP4"):
        return f"{kind}: codebook/non-affine levels, which no MNN record holds; dequantized and quantized afresh"
    return f"{kind}: no MNN record holds its blocks; dequantized and quantized afresh"


@dataclass(frozen=True)
class _Entry:
    tensor: GgufTensor
    order: torch.Tensor | None  # HF row -> GGUF row, where llama.cpp permuted the rows
    unsqueeze: int | None = None  # the axis of HF's tensor the converter squeezed away
    shift: float = 0.0  # what llama.cpp added to the values (Gemma's norms: 1), taken off in fp32

    @property
    def shape(self) -> tuple[int, ...]:
        """HF's shape of the tensor."""
        shape = self.tensor.shape
        return shape if self.unsqueeze is None else shape[:self.unsqueeze] + (1,) + shape[self.unsqueeze:]

    def stored(self) -> Prequantized | torch.Tensor:
        kind = KEPT.get(self.tensor.kind)
        if kind is not None and len(self.tensor.shape) == 2 and self.unsqueeze is None and not self.shift:
            value: Any = prequantized(kind, self.tensor.data)
        else:
            value = torch.from_numpy(self._dequantized()).reshape(self.shape)
        return value if self.order is None else value[self.order] if isinstance(value, torch.Tensor) else \
            Prequantized(value.levels[self.order], value.scales[self.order], value.biases[self.order],
                         value.bits, value.group)

    def _dequantized(self) -> np.ndarray:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(np.asarray(self.tensor.data), GGMLQuantizationType[self.tensor.kind])
        values = np.array(values, dtype=np.float32).reshape(self.tensor.shape)
        return values - np.float32(self.shift) if self.shift else values


def _expert(tensor: GgufTensor, e: int) -> GgufTensor:
    """Expert ``e`` of a stacked ``[experts, out, in]`` tensor: its 2-D slice, blocks as stored."""
    return GgufTensor(f"{tensor.name}[{e}]", tensor.kind, tensor.shape[1:], tensor.data[e])


class GgufLazy(WholeLazy):
    """An HF-named tensor of the file: ``read``/``rows``/``row_chunks``/``take`` give fp32 values."""

    def __init__(self, entry: _Entry, name: str):
        self._entry, self.name = entry, name
        self.shape = torch.Size(entry.shape)

    def read(self) -> torch.Tensor:
        value = self._entry.stored()
        return value.dequantize() if isinstance(value, Prequantized) else value

    @property
    def quantization(self) -> tuple[QuantInfo | None, ...]:
        kept = KEPT.get(self._entry.tensor.kind)
        return (None if kept is None else kept.info,)

    @property
    def label(self) -> str:
        kind = self._entry.tensor.kind
        return "unquantized" if kind in FLOAT_TYPES else kind

    def quantized_rows(self, start: int, stop: int) -> Prequantized:
        """Rows [start, stop) with their stored integers (a token table written as stored)."""
        value = self._entry.stored()
        if not isinstance(value, Prequantized):
            raise ValueError(f"{self.name} is not stored in a kept GGUF type")
        return value[start:stop]

    def quantized_chunks(self, max_bytes: int = 64 << 20) -> Iterator[Prequantized]:
        value = self.quantized_rows(0, self.shape[0])
        step = max(1, max_bytes // self.row_bytes)
        for start in range(0, self.shape[0], step):
            yield value[start:start + step]


class GgufWeights:
    """The file's tensors under their HF names; ``config``: the HF config read from its metadata
    (the head counts that undo llama.cpp's q/k permutation)."""

    format = "gguf"
    alpha_note = ("transcoded records keep llama.cpp's integers; their alpha is stored in fp32 (a K-quant's "
                  "sub-block scale d*sc and min dmin*m are exact in fp32, not in fp16)")

    def __init__(self, file: GgufFile, config: dict[str, Any]):
        self.path = file.path
        self.folder: Path | None = file.path.parent
        arch_name = str(file.metadata.get("general.architecture"))
        arch = ARCHITECTURES[arch_name]
        self._entries: dict[str, _Entry] = {}
        for name, tensor in file.tensors.items():
            if name in NOT_TENSORS:
                continue
            experts = expert_names(name, int(config["num_experts"]), arch_name) if config.get("num_experts") else None
            if experts is not None:
                self._add_experts(tensor, experts)
                continue
            hf = hf_name(name, arch_name)
            if hf is None:
                raise InputError(f"{file.path}: tensor {name!r} has no HF counterpart in a {arch_name} model")
            heads = permuted_heads(name) if arch.permuted else None
            order = None if heads is None else torch.tensor(unpermute_order(tensor.shape[0], int(config[heads])))
            shift = arch.norm_shift if name.endswith("norm.weight") else 0.0
            self._entries[hf] = _Entry(tensor, order, unsqueezed_axis(name), shift)

    def _add_experts(self, tensor: GgufTensor, names: list[str]) -> None:
        """A stacked ``[experts, out, in]`` tensor as one entry per expert (its rows' blocks kept)."""
        if len(tensor.shape) != 3 or tensor.shape[0] != len(names):
            raise InputError(f"{self.path}: tensor {tensor.name!r} has shape {list(tensor.shape)}, "
                             f"expected [{len(names)} experts, out, in]")
        for e, hf in enumerate(names):
            self._entries[hf] = _Entry(_expert(tensor, e), None)

    # --- the WeightStore interface -----------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def _get(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise InputError(f"{self.path}: the GGUF file has no tensor for {name!r}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self._get(name).shape

    def dtype(self, name: str) -> torch.dtype:
        """fp32: every tensor comes back dequantized or widened."""
        self._get(name)
        return torch.float32

    def lazy(self, name: str) -> GgufLazy:
        return GgufLazy(self._get(name), name)

    def tensor(self, name: str) -> torch.Tensor:
        return self.lazy(name).read()

    # --- the stored integers ------------------------------------------------------------------------
    def kind(self, name: str) -> str:
        """The GGUF type of ``name`` ("Q8_0", "Q4_K", "F16", ...)."""
        return self._get(name).tensor.kind

    def label(self, name: str) -> str:
        """How ``name`` is stored, for plans and reports: its GGUF type, "unquantized" for floats."""
        return self.lazy(name).label

    def quantization(self, name: str) -> tuple[QuantInfo | None, ...]:
        """The record a kept type becomes; None for every other type (``unfit`` says why)."""
        kept = KEPT.get(self.kind(name))
        return (None if kept is None else kept.info,)

    def unfit(self, name: str) -> str | None:
        kind = self.kind(name)
        return None if kind in KEPT else unkept_reason(kind)

    def stored(self, name: str, expert: int | None = None) -> Prequantized | torch.Tensor:
        """``name`` as stored, or expert ``expert`` of a stacked ``[experts, out, in]`` tensor that is one
        HF tensor too (Gemma4's ``experts.gate_up_proj``): its rows' blocks kept as a 2-D tensor's."""
        entry = self._get(name)
        if expert is None:
            return entry.stored()
        tensor = entry.tensor
        if len(tensor.shape) != 3 or not 0 <= expert < tensor.shape[0] or entry.order is not None or entry.shift:
            raise InputError(f"{self.path}: tensor {tensor.name!r} of shape {list(tensor.shape)} holds no expert "
                             f"{expert} ({name})")
        return _Entry(_expert(tensor, expert), None).stored()

    def prequantized(self, name: str, expert: int | None = None) -> Prequantized:
        value = self.stored(name, expert)
        if not isinstance(value, Prequantized):
            raise ValueError(f"{name} is not stored in a kept GGUF type")
        return value


def open_weights(path: Path, config: dict[str, Any]) -> GgufWeights:
    return GgufWeights(GgufFile(path), config)
