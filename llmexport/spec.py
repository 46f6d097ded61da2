"""The vocabulary every layer shares: linear specs and roles, expert templates, stored and
quantized weights, the quantizer type, a family's summary of itself, and the small protocols by
which a weight store and an exported model's tables are read.

This module imports nothing of llmexport, so that the checkpoint readers, importers, model
families, quantizers, the MNN writer and verification may all depend on it without depending on
each other.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Protocol

import torch
from torch import nn


# --- linears of the graph -----------------------------------------------------------------------
class LinearRole(str, Enum):
    """What a linear layer does; quantization recipes choose bits per role."""

    ATTENTION = "attention"
    MLP = "mlp"
    EXPERT = "expert"
    ROUTER = "router"
    PLE = "ple"
    LM_HEAD = "lm_head"


@dataclass(frozen=True)
class LinearSpec:
    """One placeholder linear of the graph: its name (ties node to weights), shape and role."""

    name: str
    in_features: int
    out_features: int
    role: LinearRole
    bias: bool = False


@dataclass(frozen=True)
class LinearSource:
    """Where one placeholder linear's weights live in the checkpoint: the weight tensor, the index
    along its first axis when it stacks experts, the bias tensor if any, and whether the stacked
    row is stored [in, out] (``transposed``: Qwen3-VL-MoE's released experts)."""

    weight: str
    expert: int | None = None
    bias: str | None = None
    transposed: bool = False


class NormFormula(str, Enum):
    """How an RMSNorm applies its stored weight ``w``: ``x * w``, or Gemma's ``x * (1 + w)``."""

    SCALE = "scale"
    OFFSET = "offset"


@dataclass(frozen=True)
class ScaleGroup:
    """Linears of one layer that read the same input, and the op before them that can absorb a
    per-channel scale of that input (activation-aware scaling, llmexport/calibration/folding.py).

    ``linears``: the placeholder linears reading the input. The input is the output of ``norm``
    (the checkpoint tensor of its weight, applied by ``formula``), or, with ``producer``, of the
    linear whose output channels reach them one to one (v_proj -> o_proj through attention's
    weighted sum, up_proj -> down_proj through the gating product). With grouped-query attention
    o_proj's input channel ``h * head_dim + d`` reads v's ``(h // heads_per_kv) * head_dim + d``.
    ``skip``: why the fold would not be exact (the family says so; the group is then left alone).
    """

    layer: int
    linears: tuple[str, ...]
    norm: str | None = None
    formula: NormFormula = NormFormula.SCALE
    producer: str | None = None
    heads_per_kv: int = 1
    head_dim: int = 0
    skip: str | None = None


@dataclass(frozen=True)
class GraphInputs:
    """Example inputs for tracing plus their ONNX names and dynamic axes."""

    args: tuple[torch.Tensor, ...]
    names: list[str]
    dynamic_axes: dict[str, dict[int, str]]
    output_names: list[str]


@dataclass(frozen=True)
class ExpertTemplate:
    """Routed experts exported once as a template graph and instantiated per (layer, expert).

    ``module`` maps [n, hidden] -> [n, hidden]; its placeholder names contain ``marker``, which
    each instance replaces (so the weights of that expert are found by name).
    """

    module: nn.Module
    marker: str
    hidden_size: int
    instances: tuple[tuple[int, int, str], ...]  # (layer_id, expert index, replacement for marker)


#: the reference's lm_head tensor when an export stored a tied model's head apart from its token table
UNTIED_HEAD = "lm_head.weight"


# --- quantized weights ------------------------------------------------------------------------
@dataclass
class QuantizedTensor:
    """Quantized ``[oc, ic]`` weight as ``[oc, nblocks, block]`` levels plus per-block alpha."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: Optional[torch.Tensor]
    bits: int
    block: int

    @property
    def sym(self) -> bool:
        return self.zero is None

    @property
    def shape(self) -> tuple[int, int]:
        oc, nblocks, block = self.q.shape
        return oc, nblocks * block

    def rows(self, rows: slice) -> "QuantizedTensor":
        """The records of output rows ``rows``."""
        return QuantizedTensor(self.q[rows], self.scale[rows], None if self.zero is None else self.zero[rows],
                               self.bits, self.block)

    def stored(self) -> torch.Tensor:
        """Unsigned on-disk levels ``q + 2^(bits-1)`` as uint8, same shape as ``q``."""
        if self.bits == 8:  # q + 128 overflows int8; flipping the sign bit is the same mapping
            return self.q.view(torch.uint8) ^ 0x80
        return (self.q + (1 << (self.bits - 1))).view(torch.uint8)


#: A quantizer: (weight [oc, ic], bits, block, symmetric) -> the record's levels and alpha.
Quantizer = Callable[[torch.Tensor, int, int, bool], QuantizedTensor]


@dataclass(frozen=True)
class QuantInfo:
    """Bits and group size of one tensor quantized by its source (MLX, GPTQ, AWQ); ``sym``: every
    group's value at level ``2^(bits-1)`` is 0 (a GPTQ ``sym`` checkpoint), so MNN's symmetric
    record (scales only) holds it."""

    bits: int
    group: int
    sym: bool = False

    def __str__(self) -> str:
        return f"{self.bits}-bit group {self.group}{' sym' if self.sym else ''}"


@dataclass(frozen=True)
class Precomputed:
    """A linear whose levels and alpha were chosen before the writer reached it (GPTQ calibration,
    llmexport.calibration.gptq): the writer stores ``result`` as it is, row slice by row slice."""

    result: QuantizedTensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.result.shape

    def dim(self) -> int:
        return 2

    def numel(self) -> int:
        oc, ic = self.shape
        return oc * ic

    def __getitem__(self, rows: slice) -> "Precomputed":
        return Precomputed(self.result.rows(rows))

    def levels(self, bits: int, block: int, sym: bool) -> QuantizedTensor:
        """The stored result, as a quantizer returns it (ValueError when the scheme differs)."""
        r = self.result
        if (bits, block, sym) != (r.bits, r.block, r.sym):
            raise ValueError(f"precomputed {r.bits}-bit block {r.block} {'sym' if r.sym else 'asym'} levels "
                             f"cannot be written as {bits}-bit block {block} {'sym' if sym else 'asym'}")
        return r


@dataclass(frozen=True)
class Prequantized:
    """A weight quantized by its source: ``w = scales * levels + biases`` per group of ``group``
    inputs. ``levels`` uint8 ``[..., out, in]`` in ``0 .. 2^bits - 1``; ``scales`` and ``biases``
    ``[..., out, in // group]`` in the source dtype. Indexing selects along the first axis."""

    levels: torch.Tensor
    scales: torch.Tensor
    biases: torch.Tensor
    bits: int
    group: int

    @property
    def shape(self) -> torch.Size:
        return self.levels.shape

    def dim(self) -> int:
        return self.levels.dim()

    def numel(self) -> int:
        return self.levels.numel()

    @property
    def info(self) -> QuantInfo:
        return QuantInfo(self.bits, self.group)

    @property
    def symmetric(self) -> bool:
        """Every group's value at level ``2^(bits-1)`` is exactly 0 (``biases = -2^(bits-1) * scales``)."""
        return torch.equal(self.biases.float(), -float(1 << (self.bits - 1)) * self.scales.float())

    def __getitem__(self, key: int | slice) -> "Prequantized":
        return Prequantized(self.levels[key], self.scales[key], self.biases[key], self.bits, self.group)

    def dequantize(self) -> torch.Tensor:
        """``scales * q + biases`` rounded once to fp32 (evaluated in fp64, a few million values at
        a time). Where the fp32 product of a level and a scale is exact (an 8-bit level times an
        fp16 or bf16 scale: MLX, GPTQ, most GGUF types) this is exactly the map evaluated in fp32;
        where it is not (GGUF's Q6_K: an fp16 times an int8 scale times a level), the one rounding
        gives the exact value the record holds."""
        *lead, cols = self.levels.shape
        levels = self.levels.reshape(-1, cols // self.group, self.group)
        scales, biases = (t.reshape(-1, cols // self.group, 1) for t in (self.scales, self.biases))
        out = torch.empty(levels.shape, dtype=torch.float32)
        step = max(1, (1 << 22) // max(cols, 1))
        for start in range(0, levels.shape[0], step):
            rows = slice(start, start + step)
            out[rows] = (levels[rows].double() * scales[rows].double() + biases[rows].double()).float()
        return out.reshape(*lead, cols)

    @staticmethod
    def cat(parts: list["Prequantized"]) -> "Prequantized":
        """Concatenate along the rows (axis -2); every part must share bits and group."""
        first = parts[0]
        if any(p.info != first.info for p in parts):
            raise ValueError(f"cannot join parts stored as {', '.join(str(p.info) for p in parts)}")
        levels, scales, biases = (torch.cat([getattr(p, f) for p in parts], dim=-2)
                                  for f in ("levels", "scales", "biases"))
        return Prequantized(levels, scales, biases, first.bits, first.group)

    def regrouped(self, group: int) -> "Prequantized":
        """The same values in groups of ``group`` inputs, which must divide ``self.group``: each
        group is split into runs that keep its scale and bias, so nothing is rounded."""
        if group <= 0 or self.group % group:
            raise ValueError(f"groups of {self.group} cannot be split into groups of {group}")
        runs = self.group // group
        return Prequantized(self.levels, self.scales.repeat_interleave(runs, dim=-1),
                            self.biases.repeat_interleave(runs, dim=-1), self.bits, group)

    @staticmethod
    def join_columns(parts: list["Prequantized"]) -> "Prequantized":
        """Parts side by side (along the last axis) as one weight: one width, and groups of the
        parts' ``common_group`` (a part with larger groups is ``regrouped``, exactly)."""
        bits = {p.bits for p in parts}
        if len(bits) != 1:
            raise ValueError(f"cannot join parts stored as {', '.join(str(p.info) for p in parts)}")
        group = common_group(p.group for p in parts)
        split = [p.regrouped(group) for p in parts]
        levels, scales, biases = (torch.cat([getattr(p, f) for p in split], dim=-1)
                                  for f in ("levels", "scales", "biases"))
        return Prequantized(levels, scales, biases, bits.pop(), group)


def common_group(groups: Iterable[int]) -> int:
    """The largest group that splits each of ``groups`` into whole groups (their gcd): the one
    block at which weights stored with these groups keep every scale and bias."""
    return math.gcd(*groups)


# --- what readers and writers see of checkpoints and exports --------------------------------------
class LazyRows(Protocol):
    """A tensor left on disk, read whole, by rows or in row chunks on demand (what a weight store
    offers for its big tables; ``llmexport.source.checkpoint.LazyTensor`` is the safetensors one)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int: ...

    def read(self) -> torch.Tensor: ...

    def rows(self, start: int, stop: int) -> torch.Tensor: ...

    def row_chunks(self, max_bytes: int = 64 << 20) -> Iterator[torch.Tensor]: ...

    def take(self, ids: torch.Tensor) -> torch.Tensor: ...


class WeightStore(Protocol):
    """Named tensors of a checkpoint, left on disk until read: what ``SafetensorsIndex`` offers and
    an importer (``llmexport.source.importers``) offers in HF names over another format."""

    #: the folder the tensors are read from (None for stores built in memory)
    folder: Path | None

    def names(self) -> list[str]: ...

    def __contains__(self, name: str) -> bool: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> torch.dtype: ...

    def lazy(self, name: str) -> LazyRows: ...

    def tensor(self, name: str) -> torch.Tensor: ...


class PrequantizedStore(WeightStore, Protocol):
    """A ``WeightStore`` over a checkpoint another tool quantized (``llmexport.source.importers``): values
    come back dequantized (fp32); these methods tell which tensors were stored as integers, in which
    format, and hand those integers over."""

    #: the source format, for plans and reports ("mlx-affine", "gptq", "gptq_v2", "awq-gemm")
    format: str
    #: how the records that keep its integers store their alpha, and why (plans and manifests)
    alpha_note: str

    def quantization(self, name: str) -> tuple[QuantInfo | None, ...]:
        """The stored format of each source tensor joined into ``name`` (None: stored as floats)."""
        ...

    def unfit(self, name: str) -> str | None:
        """Why the stored integers of ``name`` cannot be one MNN record at any bits and block
        (GPTQ's act-order, a GGUF type no record holds), or why a float tensor is quantized by the
        options (GGUF's F16); None when they can, or a float tensor stays as stored."""
        ...

    def label(self, name: str) -> str:
        """How ``name`` is stored, for plans and reports ("4-bit group 64", "Q4_K", "unquantized")."""
        ...

    def stored(self, name: str, expert: int | None = None) -> Prequantized | torch.Tensor:
        """A tensor (or one expert of a stacked one) as stored: integers, or floats."""
        ...

    def prequantized(self, name: str, expert: int | None = None) -> Prequantized:
        """The integers of a 2-D weight (or of one expert of a stacked 3-D one)."""
        ...


class ReferenceTensors(Protocol):
    """The HF reference model's tensors by checkpoint name, read on demand, floats widened to fp32:
    the checkpoint's own (``checkpoint.CheckpointTensors``) or what an export stored
    (``mnn.readback.StoredTensors``)."""

    def names(self) -> list[str]: ...

    def __contains__(self, name: str) -> bool: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str) -> torch.Tensor: ...

    def rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows at ``ids`` (sorted, unique) along the first dimension: a table lookup."""
        ...


class StoredModel(ReferenceTensors, Protocol):
    """What an export stored (``mnn.readback.StoredTensors``): the reference's tensors, and the
    text graph's linear records and token-table tensors one by one."""

    def text_linears(self) -> list[str]: ...

    def linear(self, record: str) -> torch.Tensor: ...

    def table_tensors(self) -> list[str]: ...


def rows_at(read_rows: Callable[[int, int], torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """Rows at ``ids`` (in their order) from a reader of row ranges, one read per run of
    consecutive ids: a prompt's few hundred ids cost a few hundred small reads, never the table."""
    flat = [int(i) for i in ids.reshape(-1)]
    if not flat:
        return read_rows(0, 0)
    order = sorted(set(flat))
    runs, start = [], 0
    for i in range(1, len(order) + 1):
        if i == len(order) or order[i] != order[i - 1] + 1:
            runs.append(read_rows(order[start], order[i - 1] + 1))
            start = i
    table = torch.cat(runs) if len(runs) > 1 else runs[0]
    position = {row: i for i, row in enumerate(order)}
    return table[torch.tensor([position[i] for i in flat], dtype=torch.long)]


class ModelTables(Protocol):
    """The token embedding and PLE tables of a model, as readers of an export need them."""

    @property
    def tied_embedding(self) -> bool: ...

    def embedding_table(self) -> LazyRows: ...

    def ple_table(self) -> LazyRows | None: ...


class SourcedModel(ModelTables, Protocol):
    """A model that names the checkpoint tensors behind each of its placeholder linears."""

    def linears(self) -> list[LinearSpec]: ...

    def linear_source(self, name: str) -> LinearSource: ...


class SourcedTower(Protocol):
    """A tower's linears and the checkpoint tensors behind each (``models.base.Tower``)."""

    name: str

    def linears(self) -> list[LinearSpec]: ...

    def linear_source(self, name: str) -> LinearSource: ...


# --- what a family says of itself ---------------------------------------------------------------
@dataclass(frozen=True)
class ArchitectureSummary:
    """What ``Architecture.describe()`` returns (--dry-run, the plan, the manifest): the fields every
    family reports, and its own ones in ``details`` (ple_dim, moe, heads, ...), which JSON places
    between the two groups."""

    family: str
    model_type: str
    layers: int
    hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    layer_kinds: tuple[str, ...]
    details: Mapping[str, Any] = field(default_factory=dict)

    _HEAD = ("family", "model_type", "layers", "hidden_size", "vocab_size")
    _TAIL = ("tied_embeddings", "layer_kinds")

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ArchitectureSummary:
        known = cls._HEAD + cls._TAIL
        return cls(**{k: data[k] for k in cls._HEAD}, tied_embeddings=data["tied_embeddings"],
                   layer_kinds=tuple(data["layer_kinds"]), details={k: v for k, v in data.items() if k not in known})

    def to_json(self) -> dict[str, Any]:
        return {**{k: getattr(self, k) for k in self._HEAD}, **self.details,
                "tied_embeddings": self.tied_embeddings, "layer_kinds": list(self.layer_kinds)}



# --- how an importer's source format names a family's tensors ------------------------------------
@dataclass(frozen=True)
class MlxRule:
    """One MLX tensor name pattern and the HF tensor(s) it holds (first matching rule wins).

    ``hf``: the ``re`` replacement giving the HF name. ``split``: the MLX tensor stacks experts
    along axis 0 and ``hf`` holds ``{e}``, one HF tensor per expert. ``part``: (index, count) when
    ``count`` MLX tensors are one HF tensor joined along the rows (axis -2), in index order.
    ``transpose``: a float tensor whose last two axes are HF's swapped (mlx-lm's ``Conv1d`` kernel
    ``[C, K, 1]`` for HF's ``[C, 1, K]``). ``offset``: a float tensor mlx-lm stores as HF's value
    plus ``offset`` (norm gammas whose ``1 + w`` mlx-lm folds in); HF's value is read back as
    ``stored - offset`` in fp32.
    """

    pattern: str
    hf: str
    split: bool = False
    part: tuple[int, int] = (0, 1)
    transpose: bool = False
    offset: float = 0.0

    @property
    def reshapes(self) -> bool:
        """Whether HF's value differs from the stored one (only float tensors can be mapped back)."""
        return self.transpose or self.offset != 0.0


@dataclass(frozen=True)
class MlxLayout:
    """How a family's mlx-lm port names tensors: renames, stacked/joined experts, and the config
    entries of parts mlx-lm drops (their tensors are absent from the MLX checkpoint)."""

    rules: tuple[MlxRule, ...] = ()
    dropped_config: tuple[str, ...] = ()

    def hf_name(self, mlx_name: str) -> tuple[str, MlxRule | None]:
        for rule in self.rules:
            if re.match(rule.pattern, mlx_name):
                return re.sub(rule.pattern, rule.hf, mlx_name), rule
        return mlx_name, None
