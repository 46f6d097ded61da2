"""What the exporter needs to know of an architecture family, and nothing more.

An ``Architecture`` is built from an opened checkpoint. It owns every family quirk: how to
read its config, which tensors exist and which linear layer each one feeds, the trace-friendly
rewrite, the runtime keys of ``llm_config.json`` and how to load the HF reference model.
Code outside ``llmexport/models`` only talks to this interface.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import torch
from torch import nn

from llmexport.mnn.config import Precision
from llmexport.models.tower_check import TowerCheck
from llmexport.source.checkpoint import Checkpoint
from llmexport.spec import (
    ArchitectureSummary,
    ExpertTemplate,
    GraphInputs,
    LazyRows,
    LinearSource,
    LinearSpec,
    ReferenceTensors,
    ScaleGroup,
)


class Tower(abc.ABC):
    """A multimodal encoder exported as its own MNN graph (``{name}.mnn`` + ``{name}.mnn.weight``).

    Same streaming contract as the text graph: placeholder linears in ``build_graph``, weights
    pulled per linear by name, whose checkpoint tensors (``linear_source``) are also the HF
    reference model's parameters. ``llm_config``/``runtime_config`` return the keys the runtime
    reads for this tower; ``check`` describes what verification compares with HF (it runs nothing).
    """

    #: file stem and report key ("visual", "audio")
    name: str = ""

    @abc.abstractmethod
    def linears(self) -> list["LinearSpec"]: ...

    @abc.abstractmethod
    def linear_weight(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    @abc.abstractmethod
    def linear_source(self, name: str) -> "LinearSource": ...

    @abc.abstractmethod
    def build_graph(self, token_tail: torch.Tensor | None = None) -> nn.Module:
        """The tower's graph; ``token_tail``: what the runtime's token input holds after the
        embedding columns at a soft token's position (the stored PLE row of HF's id for media
        positions, mnn/token_table.py), which each soft token must carry; None: nothing."""

    @abc.abstractmethod
    def graph_inputs(self) -> "GraphInputs": ...

    def llm_config(self) -> dict[str, Any]:
        return {}

    def runtime_config(self) -> dict[str, Any]:
        return {}

    @abc.abstractmethod
    def check(self) -> TowerCheck:
        """The exported tower's parity checks against HF (llmexport/verification/towers.py runs them)."""


class Architecture(abc.ABC):
    """Base class of an architecture family (registered by ``model_type`` in ``models.FAMILIES``)."""

    #: True when ``load_reference`` runs the checkpoint's own modeling code (``auto_map``), which
    #: verification then does only with the user's explicit ``trust_remote_code``
    reference_is_remote_code: bool = False

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint

    # --- description -------------------------------------------------------------------
    @abc.abstractmethod
    def describe(self) -> ArchitectureSummary:
        """Plan summary: family, layer count and per-layer kinds (for --dry-run and the manifest)."""

    @abc.abstractmethod
    def linears(self) -> list[LinearSpec]:
        """Every placeholder linear of the graph."""

    @abc.abstractmethod
    def linear_weight(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The checkpoint tensors (weight [out, in], bias) behind one placeholder linear."""

    def linear_source(self, name: str) -> LinearSource:
        """The checkpoint tensors behind one placeholder linear (what ``linear_weight`` reads)."""
        raise NotImplementedError(f"{type(self).__name__} does not name the tensors behind its linears")

    def scale_groups(self) -> list[ScaleGroup]:
        """Where a per-channel scale of a linear's input can be folded into the op before it
        (activation-aware scaling, llmexport/calibration/folding.py); none by default: such a family's linears
        are then rounded without it."""
        return []

    @classmethod
    def mlx_layout(cls, config: dict[str, Any]) -> Any:
        """How the family's mlx-lm port names its tensors (``llmexport.spec.MlxLayout``);
        None: MLX-quantized checkpoints of this family are not supported."""
        return None

    @property
    @abc.abstractmethod
    def tied_embedding(self) -> bool:
        """True when the runtime reads the token embedding out of the lm_head record."""

    @abc.abstractmethod
    def embedding_table(self) -> LazyRows:
        """The token embedding [vocab, hidden], left on disk until rows are asked for."""

    def ple_table(self) -> LazyRows | None:
        """A per-layer-embedding table [vocab, layers * dim], if the family has one."""
        return None

    def media_ple_id(self) -> int:
        """The token whose PLE row HF reads at media (soft-token) positions."""
        return 0

    # --- graph -------------------------------------------------------------------------
    @abc.abstractmethod
    def build_graph(self) -> nn.Module:
        """The trace-friendly rewrite with placeholder linears (small tensors loaded)."""

    @abc.abstractmethod
    def graph_inputs(self, seq_len: int) -> GraphInputs:
        """Tracing inputs in the runtime's layout."""

    def expert_templates(self) -> list[ExpertTemplate]:
        """Routed experts to export as MNN MoE subgraphs (one template per kind of expert).
        Instances of all templates share one namespace ``/expert/{layer_id}_{e}``: a family with
        two kinds of routed modules in one layer gives them distinct ``layer_id`` values."""
        return []

    def towers(self) -> list[Tower]:
        """Multimodal encoders present in the checkpoint and exported beside the text graph."""
        return []

    # --- runtime files -----------------------------------------------------------------
    @abc.abstractmethod
    def llm_config(self) -> dict[str, Any]:
        """Family keys of llm_config.json (attention type, scales, chat template, PLE scale...)."""

    #: config.json's activation precision: ``low`` (fp16 on ARM) where MNN's ARM kernels were
    #: measured to hold it for the family, else ``normal`` (docs/benchmarks.md, fp16 on ARM)
    precision: ClassVar[Precision] = Precision.NORMAL

    def runtime_config(self) -> dict[str, Any]:
        """Family keys of config.json: its activation precision (``--precision`` overrides it)."""
        return {"precision": self.precision.value}

    def end_of_turn_tokens(self) -> tuple[str, ...]:
        """Tokens that close a chat turn. Those the tokenizer has stop generation, beside its
        eos token and generation_config.json's ``eos_token_id`` (the tokenizer file's stop list)."""
        return ()

    # --- reference -----------------------------------------------------------------------
    @abc.abstractmethod
    def load_reference(self, stored: ReferenceTensors | None, trust_remote_code: bool = False) -> nn.Module:
        """The HF model in fp32, built from the checkpoint's safetensors (never a pickle);
        ``stored`` replaces the checkpoint values with its own (what the export wrote: the fair
        oracle for the runtime). ``trust_remote_code`` is passed on to transformers."""

    @abc.abstractmethod
    def empty_reference(self, trust_remote_code: bool = False) -> nn.Module:
        """The same HF model with its parameters on the meta device (llmexport/reference/streamed.py fills them)."""

    @abc.abstractmethod
    def reference_slot(self, tensor: str) -> tuple[str, tuple[Any, ...]]:
        """Where a checkpoint tensor lives in the reference: the state-dict entry and the index
        within it (``()``: all of it; transformers stacks some checkpoints' per-expert tensors)."""

    def reference_transposed(self, tensor: str) -> bool:
        """Whether the reference holds checkpoint ``tensor`` with its last two axes swapped
        (transformers' conversion mapping transposes Qwen3-VL-MoE's released stacked experts on
        load); no tensor by default."""
        return False

    @abc.abstractmethod
    def reference_logits(self, model: nn.Module, ids: torch.Tensor, first: int = 0) -> torch.Tensor:
        """Logits [seq - first, vocab] of the reference at the positions from ``first`` on, for one
        prompt of token ids (the lm_head runs on those positions only)."""
