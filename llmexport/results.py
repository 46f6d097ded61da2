"""What the library returns: the export plan, the verification report and an export's result.

Plain data that every layer may import (the pipeline builds them, the API and the CLI read
them). ``to_json()`` gives the JSON-ready dict that is printed and written (``verify.json`` is
written in this key order; the manifest copies parts of the plan) and ``from_json()`` reads one
back. Sections that other modules produce and only pass through to JSON (the towers' reports,
the pre-quantized checkpoint's summaries, the family-specific architecture fields) stay dicts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Sequence, TypeVar

from llmexport.options import RuntimeProfile
from llmexport.quant.scheme import QuantMethod
from llmexport.spec import LinearRole

_T = TypeVar("_T", bound="_PlainFields")


class _PlainFields:
    """JSON of a dataclass whose fields are plain values: one key per field, in field order."""

    @classmethod
    def from_json(cls: type[_T], data: Mapping[str, Any]) -> _T:
        return cls(**data)

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]


# --- the plan (--dry-run, llmexport.plan) ---------------------------------------------------------
@dataclass(frozen=True)
class ArchitectureSummary:
    """``Architecture.describe()`` typed: the fields every family reports, and its own ones in
    ``details`` (ple_dim, moe, heads, ...), which JSON places between the two groups."""

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


@dataclass(frozen=True)
class PlannedLinear:
    """One placeholder linear and the scheme it is written with (``block`` as used, 0 for fp16)."""

    name: str
    role: LinearRole
    out_features: int
    in_features: int
    bits: int
    block: int
    sym: bool
    method: QuantMethod

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PlannedLinear:
        out_features, in_features = data["shape"]
        return cls(data["name"], LinearRole(data["role"]), out_features, in_features, data["bits"], data["block"],
                   data["sym"], QuantMethod(data["method"]))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "role": self.role.value, "shape": [self.out_features, self.in_features],
                "bits": self.bits, "block": self.block, "sym": self.sym, "method": self.method.value}


@dataclass(frozen=True)
class AdjustedBlock(_PlainFields):
    """A requested block that does not divide a linear's input width, and the block used instead."""

    name: str
    in_features: int
    requested: int
    used: int


@dataclass(frozen=True)
class PlannedTable(_PlainFields):
    """An embedding or PLE table written to its own file."""

    rows: int
    dim: int
    bits: int


@dataclass(frozen=True)
class ExportPlan:
    """What an export writes (``--dry-run`` prints it): the architecture, each linear's scheme, the
    adjusted blocks, the tables and the exact size of the weight files; ``prequantized``: what a
    pre-quantized (MLX) checkpoint keeps as stored (llmexport.weight_sources.WeightSources.summary)."""

    architecture: ArchitectureSummary
    linears: tuple[PlannedLinear, ...]
    adjusted_blocks: tuple[AdjustedBlock, ...]
    tables: Mapping[str, PlannedTable]
    estimated_bytes: int
    prequantized: dict[str, Any] | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ExportPlan:
        return cls(ArchitectureSummary.from_json(data["architecture"]),
                   tuple(PlannedLinear.from_json(x) for x in data["linears"]),
                   tuple(AdjustedBlock.from_json(x) for x in data["adjusted_blocks"]),
                   {name: PlannedTable.from_json(t) for name, t in data["tables"].items()},
                   data["estimated_bytes"], data.get("prequantized"))

    def to_json(self) -> dict[str, Any]:
        out = {"architecture": self.architecture.to_json(), "linears": [x.to_json() for x in self.linears],
               "adjusted_blocks": [x.to_json() for x in self.adjusted_blocks],
               "tables": {name: t.to_json() for name, t in self.tables.items()},
               "estimated_bytes": self.estimated_bytes}
        if self.prequantized is not None:
            out["prequantized"] = self.prequantized
        return out


# --- the verification report (verify.json, llmexport.verify) -------------------------------------
@dataclass(frozen=True)
class StepStats(_PlainFields):
    """One teacher-forced step: MNN's logits against the reference's."""

    max_abs_err: float
    mean_abs_err: float
    ref_top2_margin: float
    top1_match: bool
    mnn_top1: int
    ref_top1: int

    @property
    def flipped(self) -> bool:
        """A top-1 disagreement that counts: the reference's own top-2 margin is not below the
        error measured at this step (below it, the step is a near-tie)."""
        return not self.top1_match and self.ref_top2_margin >= self.max_abs_err


@dataclass(frozen=True)
class LogitStats:
    """Teacher-forced logits of a run against a reference, over all steps."""

    top1_agreement: float
    max_abs_err: float
    mean_abs_err: float
    per_step: tuple[StepStats, ...]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LogitStats:
        return cls(data["top1_agreement"], data["max_abs_err"], data["mean_abs_err"],
                   tuple(StepStats.from_json(s) for s in data["per_step"]))

    def to_json(self) -> dict[str, Any]:
        return {"top1_agreement": self.top1_agreement, "max_abs_err": self.max_abs_err,
                "mean_abs_err": self.mean_abs_err, "per_step": [s.to_json() for s in self.per_step]}


@dataclass(frozen=True)
class RunComparison(LogitStats):
    """A runtime run against the stored-weights oracle: greedy ids on each side, and the
    teacher-forced statistics (both fed the oracle's greedy ids)."""

    greedy_ref: tuple[int, ...]
    greedy_mnn: tuple[int, ...]

    @property
    def greedy_match(self) -> bool:
        return self.greedy_ref == self.greedy_mnn

    @classmethod
    def of(cls, stats: LogitStats, greedy_ref: Sequence[int], greedy_mnn: Sequence[int]) -> RunComparison:
        return cls(stats.top1_agreement, stats.max_abs_err, stats.mean_abs_err, stats.per_step, tuple(greedy_ref),
                   tuple(greedy_mnn))

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunComparison:
        run = cls.of(LogitStats.from_json(data), data["greedy_ref"], data["greedy_mnn"])
        if run.greedy_match != data["greedy_match"]:
            raise ValueError(f"run comparison: greedy_match={data['greedy_match']} with greedy ids "
                             f"{data['greedy_ref']} vs {data['greedy_mnn']}")
        return run

    def to_json(self) -> dict[str, Any]:
        return {"greedy_ref": list(self.greedy_ref), "greedy_mnn": list(self.greedy_mnn),
                "greedy_match": self.greedy_match, **super().to_json()}


@dataclass(frozen=True)
class TokenizerCheck:
    """The runtime's tokenizer against HF's on the sample texts and the prompt."""

    agree: bool
    cases: int
    mismatches: tuple[str, ...]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TokenizerCheck:
        return cls(data["agree"], data["cases"], tuple(data["mismatches"]))

    def to_json(self) -> dict[str, Any]:
        return {"agree": self.agree, "cases": self.cases, "mismatches": list(self.mismatches)}


@dataclass(frozen=True)
class Bounds(_PlainFields):
    """Pass criteria against the stored-weights oracle, for the runtime profile an export ships
    (chosen by llmexport.verification.bounds_for_export, calibrated in docs/verification.md).

    ``max_abs_err`` / ``mean_abs_err`` bound the run with the shipped config.json;
    ``kernels_max_abs_err`` bounds the run on MNN's exact kernels that a fast export with
    quantized linears also gets (that run proves the graph and the records).
    """

    profile: str
    max_abs_err: float
    mean_abs_err: float | None = None
    kernels_max_abs_err: float | None = None


@dataclass(frozen=True)
class VerifyReport:
    """The verification of an export (docs/verification.md); ``passed`` when nothing failed."""

    prompt_tokens: int
    steps: int
    tokenizer: TokenizerCheck
    runtime_profile: RuntimeProfile
    oracle: RunComparison
    fp32: LogitStats
    bounds: Bounds
    failures: tuple[str, ...]
    towers: Mapping[str, dict[str, Any]] = field(default_factory=dict)
    prequantized: dict[str, Any] | None = None
    exact_kernels: RunComparison | None = None

    @property
    def passed(self) -> bool:
        return not self.failures

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> VerifyReport:
        report = cls(data["prompt_tokens"], data["steps"], TokenizerCheck.from_json(data["tokenizer"]),
                     RuntimeProfile(data["runtime_profile"]), RunComparison.from_json(data["oracle"]),
                     LogitStats.from_json(data["fp32"]), Bounds.from_json(data["bounds"]), tuple(data["failures"]),
                     dict(data["towers"]), data.get("prequantized"),
                     None if "exact_kernels" not in data else RunComparison.from_json(data["exact_kernels"]))
        if report.passed != data["passed"]:
            raise ValueError(f"verification report: passed={data['passed']} with {len(report.failures)} failure(s)")
        return report

    @classmethod
    def read(cls, path: str | Path) -> VerifyReport:
        """A ``verify.json`` written by ``--verify``."""
        return cls.from_json(json.loads(Path(path).read_text()))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens, "steps": self.steps, "tokenizer": self.tokenizer.to_json(),
            "runtime_profile": self.runtime_profile.value, "oracle": self.oracle.to_json(),
            "fp32": self.fp32.to_json(), "towers": dict(self.towers)}
        if self.prequantized is not None:
            out["prequantized"] = self.prequantized
        if self.exact_kernels is not None:
            out["exact_kernels"] = self.exact_kernels.to_json()
        out.update(bounds=self.bounds.to_json(), failures=list(self.failures), passed=self.passed)
        return out


# --- the export ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExportResult:
    """An export: its folder, the files in it, the plan it followed, seconds per stage, and the
    verification report when ``verify`` was asked."""

    dst: Path
    files: tuple[str, ...]
    plan: ExportPlan
    timings: dict[str, float] = field(default_factory=dict)
    verification: VerifyReport | None = None
