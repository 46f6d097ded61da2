"""HF's reference model with its weights left on disk: one block in memory at a time.

The fp32 reference of a real-size model does not fit beside anything (E4B: 30 GB), yet
verification needs nothing of it but its forward. So the model is built by transformers with
its parameters on the meta device (``Architecture.empty_reference``; buffers such as rotary
frequencies are built as usual), and forward hooks fill it from a ``ReferenceTensors`` (the
checkpoint's tensors, or what the export stored) while it runs:

- a block, each child of an ``nn.ModuleList`` (decoder layers, a tower's encoder layers), and
  the lm_head get their parameters read just before they run and dropped right after;
- a token table (an ``nn.Embedding`` outside the blocks) holds no values (``RowTable``): a lookup
  reads the rows of its ids (its forward, scaling included, is HF's own, and so is a direct read
  such as Gemma4's ``embed_tokens.weight[pad_token_id]``);
- everything else (norms, small projections, tower stems) is read once and stays.

Each module computes with the very parameter values the full model holds, in the same order, so
the logits are those of ``Architecture.load_reference`` bit for bit once that model's parameters
sit in fresh allocations as these do (tests/test_streamed_reference.py; CPU matmul kernels pick
their code path by the operands' alignment, and transformers' loader places parameters at other
offsets: that alone moves the full model's own logits by ~1e-6). Memory is the largest block
(or the lm_head) plus the residents plus activations, whatever the depth.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, cast

import torch
from torch import nn

from llmexport.models.base import Architecture
from llmexport.quant.workers import malloc_policy
from llmexport.spec import ReferenceTensors

#: bytes per value of the reference's parameters (fp32)
_FLOAT_BYTES = 4
#: where parameters start in memory (torch's own allocations): CPU matmul kernels take other paths
#: for other alignments, which moves fp32 results by an ulp or so
_ALIGNMENT = 64


@dataclass(frozen=True)
class _Slot:
    """One parameter of the reference: the module and attribute holding it, its state-dict name."""

    owner: nn.Module
    attr: str
    name: str
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * _FLOAT_BYTES

    def set(self, value: torch.Tensor) -> None:
        if not isinstance(value, RowTable) and value.data_ptr() % _ALIGNMENT:  # e.g. a view into a buffer
            value = value.clone()
        self.owner._parameters[self.attr] = nn.Parameter(value, requires_grad=False)

    def clear(self) -> None:
        self.set(torch.empty(self.shape, device="meta"))


@dataclass
class ReferenceLayout:
    """The reference's parameters sorted by when they are in memory."""

    blocks: dict[str, list[_Slot]] = field(default_factory=dict)  # module name -> its parameters
    tables: dict[str, _Slot] = field(default_factory=dict)  # embedding module name -> its weight
    resident: list[_Slot] = field(default_factory=list)

    @classmethod
    def of(cls, model: nn.Module) -> ReferenceLayout:
        head = cast(Any, model).get_output_embeddings()
        layout = cls()
        for name, module in model.named_modules(remove_duplicate=False):
            if layout.block_of(name) is not None:
                continue
            if module is head or isinstance(_parent(model, name), nn.ModuleList):
                layout.blocks[name] = []
            elif isinstance(module, nn.Embedding) and module.max_norm is None:
                layout.tables[name] = None  # type: ignore[assignment]  # filled below
        for name, param in model.named_parameters(remove_duplicate=False):
            module_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(module_name)
            slot = _Slot(owner, attr, name, param.shape)
            block = layout.block_of(name)
            if block is not None:
                layout.blocks[block].append(slot)
            elif module_name in layout.tables and attr == "weight":
                layout.tables[module_name] = slot
            else:
                layout.resident.append(slot)
        return layout

    def block_of(self, name: str) -> str | None:
        return next((b for b in self.blocks if name == b or name.startswith(b + ".")), None)

    def resident_bytes(self) -> int:
        return sum(s.nbytes for s in self.resident)

    def largest_block_bytes(self) -> int:
        return max((sum(s.nbytes for s in slots) for slots in self.blocks.values()), default=0)



def _parent(model: nn.Module, name: str) -> nn.Module | None:
    if not name:
        return None
    return model.get_submodule(name.rpartition(".")[0])


class _Filler:
    """Reads the reference's parameters from ``tensors``: by state-dict name, through the family's
    ``reference_slot`` where transformers holds a checkpoint tensor elsewhere (stacked experts), or
    through transformers' ties (a tied lm_head reads the embedding)."""

    def __init__(self, arch: Architecture, model: nn.Module, tensors: ReferenceTensors):
        self.tensors = tensors
        self.ties: dict[str, str] = dict(getattr(model, "all_tied_weights_keys", None) or {})
        self.writers: dict[str, list[tuple[str, tuple[Any, ...], bool]]] = {}
        for tensor in tensors.names():
            name, index = arch.reference_slot(tensor)
            transposed = arch.reference_transposed(tensor)
            if (name, index) != (tensor, ()) or transposed:
                self.writers.setdefault(name, []).append((tensor, index, transposed))
        #: parameters held whole under another name (a decoder nested under another prefix)
        self.renamed = {name: writers[0][0] for name, writers in self.writers.items()
                        if len(writers) == 1 and writers[0][1:] == ((), False)}

    def source(self, name: str) -> str:
        for candidate in (name, self.ties.get(name, name)):
            if candidate in self.tensors:
                return candidate
            if candidate in self.renamed:
                return self.renamed[candidate]
        raise ValueError(f"the reference's parameter {name!r} is not among the checkpoint's tensors")

    def read(self, slot: _Slot) -> torch.Tensor:
        if slot.name in self.writers:
            value = torch.empty(slot.shape, dtype=torch.float32)
            for tensor, index, transposed in self.writers[slot.name]:
                part = self.tensors.read(tensor)
                value[index] = part.transpose(-1, -2) if transposed else part
        else:
            value = self.tensors.read(self.source(slot.name))
        if value.shape != slot.shape:
            raise ValueError(f"{slot.name}: {tuple(value.shape)} read for a parameter of shape {tuple(slot.shape)}")
        return value

    def rows(self, slot: _Slot, ids: torch.Tensor) -> torch.Tensor:
        return self.tensors.rows(self.source(slot.name), ids)


def streamed_reference(arch: Architecture, tensors: ReferenceTensors, trust_remote_code: bool = False) -> nn.Module:
    """``arch``'s HF reference whose parameters come from ``tensors`` as it runs (see module doc);
    run it under ``mapped_blocks()``."""
    model = arch.empty_reference(trust_remote_code)
    layout = ReferenceLayout.of(model)
    filler = _Filler(arch, model, tensors)
    with torch.no_grad():
        for slot in layout.resident:
            slot.set(filler.read(slot))
        _load_buffers(model, tensors)
    for name, slots in layout.blocks.items():
        _stream_block(model.get_submodule(name), slots, filler)
    for slot in layout.tables.values():
        slot.set(RowTable(slot.shape, functools.partial(filler.rows, slot)))
    return model


def mapped_blocks() -> contextlib.AbstractContextManager[None]:
    """Blocks of 1 MiB and more mapped on their own while the references run: a layer's weights
    freed into glibc's heap fragment it, and a full-depth E4B-shaped fp32 forward (600 tokens) then
    peaked at 5.5 GiB and kept 1.8 GiB after it; mapped, 4.2 GiB and 0.5 GiB."""
    return malloc_policy(mmap_threshold=1 << 20)


#: positions whose logits verification asks for at once (24 steps; a conversation turn's 8 answer
#: steps; a media prompt's 16), with room to spare
VERIFY_POSITIONS = 64
#: copies of those logits alive at once: the lm_head's output, softcapping's, the copy handed back
_LOGIT_COPIES = 3


class ReferenceFootprint(NamedTuple):
    """Bytes verification's two streamed references (the oracle and the fp32 model, both alive)
    hold: between calls (``idle``: both references' residents, while MNN's runtime runs beside
    them) and at the worst moment of a call (``peak``: also the largest block of one and the
    logits of ``VERIFY_POSITIONS`` positions; hidden states, a few MB at these lengths, aside).
    ``resident`` and ``largest_block``: one reference's parts."""

    idle: int
    peak: int
    resident: int = 0
    largest_block: int = 0


def reference_footprint(arch: Architecture, trust_remote_code: bool = False) -> ReferenceFootprint:
    model = arch.empty_reference(trust_remote_code)
    layout = ReferenceLayout.of(model)
    vocab = int(cast(Any, model).get_output_embeddings().weight.shape[0])
    idle = 2 * layout.resident_bytes()
    return ReferenceFootprint(idle, idle + layout.largest_block_bytes() + _LOGIT_COPIES * VERIFY_POSITIONS * vocab * 4,
                              layout.resident_bytes(), layout.largest_block_bytes())


def _load_buffers(model: nn.Module, tensors: ReferenceTensors) -> None:
    """Persistent buffers the checkpoint holds (Gemma4's ``layer_scalar``) take its values."""
    for name, buffer in model.state_dict(keep_vars=True).items():
        if name in tensors and not isinstance(buffer, nn.Parameter):
            buffer.copy_(tensors.read(name))


def _stream_block(module: nn.Module, slots: list[_Slot], filler: _Filler) -> None:
    def fill(*_: Any) -> None:
        for slot in slots:
            slot.set(filler.read(slot))

    def clear(*_: Any) -> None:
        for slot in slots:
            slot.clear()

    module.register_forward_pre_hook(fill)
    module.register_forward_hook(clear, always_call=True)


class RowTable(torch.Tensor):
    """A token table that holds no values: a lookup (``F.embedding``, ``weight[i]``, ``weight[ids]``,
    ``weight[a:b]``) reads just those rows from the tensors. HF's forward sees a float32 tensor of the
    table's shape; an operation that needs all of it reads all of it."""

    rows_of: Callable[[torch.Tensor], torch.Tensor]

    @staticmethod
    def __new__(cls, shape: torch.Size, rows_of: Callable[[torch.Tensor], torch.Tensor]) -> RowTable:
        table = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32, device=torch.device("cpu"))
        table.rows_of = rows_of
        return table

    def __repr__(self) -> str:  # type: ignore[override]
        return f"RowTable{tuple(self.shape)}"

    def take(self, ids: torch.Tensor) -> torch.Tensor:
        unique, order = torch.unique(ids.reshape(-1), sorted=True, return_inverse=True)
        return self.rows_of(unique)[order].reshape(*ids.shape, *self.shape[1:])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:
        aten, table = torch.ops.aten, args[0]
        if func is aten.embedding.default:
            return table.take(args[1])
        if func is aten.select.int and args[1] == 0:
            return table.take(torch.tensor(args[2]))
        if func is aten.index.Tensor and len(args[1]) == 1:
            return table.take(args[1][0])
        if func is aten.slice.Tensor and args[1] == 0:
            start, stop, step = (list(args[2:]) + [None, None, 1])[:3]
            return table.take(torch.arange(table.shape[0])[slice(start, stop, step)])
        if func in (aten.detach.default, aten.alias.default):
            return RowTable(table.shape, table.rows_of)
        whole = [a.take(torch.arange(a.shape[0])) if isinstance(a, RowTable) else a for a in args]
        return func(*whole, **(kwargs or {}))
