"""What the library returns: the export plan, the verification report and an export's result.

Plain data that every layer may import (the pipeline builds them, the API and the CLI read
them). ``to_json()`` gives the JSON-ready dict that is printed and written (``verify.json`` is
written in this key order; the manifest copies parts of the plan) and ``from_json()`` reads one
back. Sections that other modules produce and only pass through to JSON (the verification's
pre-quantized summary, the family-specific architecture fields, a tower's own case and prompt
fields) stay dicts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Sequence, TypeVar

from llmexport.mnn.config import RuntimeProfile
from llmexport.quant.budget import BudgetSummary
from llmexport.quant.scheme import QuantMethod
from llmexport.spec import ArchitectureSummary, LinearRole
from llmexport.verification.quality import QualityStats

__all__ = ["ArchitectureSummary"]  # the families make it (llmexport.spec); the plan carries it

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
class ChangedLinear(_PlainFields):
    """A linear of a pre-quantized checkpoint written with the export's scheme instead of as stored."""

    name: str
    stored: str
    reason: str
    bits: int
    block: int


@dataclass(frozen=True)
class PrequantizedTable(_PlainFields):
    """How a pre-quantized checkpoint's token table is written: kept as stored, or why not."""

    stored: str | None
    bits: int
    block: int
    kept: bool
    reason: str | None


@dataclass(frozen=True)
class PrequantizedSummary:
    """What a pre-quantized (MLX) checkpoint keeps as stored and what it does not, with the reasons
    (llmexport.planning.schemes.Schemes.prequantized; the plan, ``--dry-run`` and the manifest)."""

    format: str
    default: str
    alpha: str
    transcoded: int
    kept_float: tuple[str, ...]
    requantized: tuple[ChangedLinear, ...]
    quantized_from_float: tuple[ChangedLinear, ...]
    tables: Mapping[str, PrequantizedTable]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PrequantizedSummary:
        return cls(data["format"], data["default"], data["alpha"], data["transcoded"], tuple(data["kept_float"]),
                   tuple(ChangedLinear.from_json(e) for e in data["requantized"]),
                   tuple(ChangedLinear.from_json(e) for e in data["quantized_from_float"]),
                   {name: PrequantizedTable.from_json(t) for name, t in data["tables"].items()})

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "default": self.default, "alpha": self.alpha, "transcoded": self.transcoded,
                "kept_float": list(self.kept_float), "requantized": [e.to_json() for e in self.requantized],
                "quantized_from_float": [e.to_json() for e in self.quantized_from_float],
                "tables": {name: t.to_json() for name, t in self.tables.items()}}


@dataclass(frozen=True)
class MemoryPlan(_PlainFields):
    """Expected peak resident memory, in bytes (llmexport.planning.memory_plan): of the export, of
    ``--verify`` (None when the export is not verified) and of its optional run on MNN's exact
    kernels (a fast export with quantized linears; skipped, and reported, where it does not fit)."""

    export_bytes: int
    verify_bytes: int | None = None
    exact_kernels_bytes: int | None = None


@dataclass(frozen=True)
class PlannedTower:
    """A multimodal tower's linears with their schemes, and the exact bytes of their records in
    ``{name}.mnn.weight`` (which also holds the constants MNN's converter moves out of the graph)."""

    linears: tuple[PlannedLinear, ...]
    adjusted_blocks: tuple[AdjustedBlock, ...]
    record_bytes: int

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PlannedTower:
        return cls(tuple(PlannedLinear.from_json(x) for x in data["linears"]),
                   tuple(AdjustedBlock.from_json(x) for x in data["adjusted_blocks"]), data["record_bytes"])

    def to_json(self) -> dict[str, Any]:
        return {"linears": [x.to_json() for x in self.linears],
                "adjusted_blocks": [x.to_json() for x in self.adjusted_blocks], "record_bytes": self.record_bytes}


@dataclass(frozen=True)
class ExportPlan:
    """What an export writes (``--dry-run`` prints it): the architecture, each linear's scheme, the
    adjusted blocks, the tables and the exact size of the weight files; ``prequantized``: what a
    pre-quantized (MLX) checkpoint keeps as stored (llmexport.planning.schemes.Schemes.prequantized); ``towers``:
    each multimodal tower's linears and record bytes; ``budget``: what ``--target_bpw`` chose and why;
    ``memory``: the expected peak memory of the export and its verification."""

    architecture: ArchitectureSummary
    linears: tuple[PlannedLinear, ...]
    adjusted_blocks: tuple[AdjustedBlock, ...]
    tables: Mapping[str, PlannedTable]
    estimated_bytes: int
    prequantized: PrequantizedSummary | None = None
    memory: MemoryPlan | None = None
    towers: Mapping[str, PlannedTower] = field(default_factory=dict)
    budget: BudgetSummary | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ExportPlan:
        memory, pre, budget = data.get("memory"), data.get("prequantized"), data.get("budget")
        return cls(ArchitectureSummary.from_json(data["architecture"]),
                   tuple(PlannedLinear.from_json(x) for x in data["linears"]),
                   tuple(AdjustedBlock.from_json(x) for x in data["adjusted_blocks"]),
                   {name: PlannedTable.from_json(t) for name, t in data["tables"].items()},
                   data["estimated_bytes"], None if pre is None else PrequantizedSummary.from_json(pre),
                   None if memory is None else MemoryPlan.from_json(memory),
                   {name: PlannedTower.from_json(t) for name, t in data.get("towers", {}).items()},
                   None if budget is None else BudgetSummary.from_json(budget))

    def to_json(self) -> dict[str, Any]:
        out = {"architecture": self.architecture.to_json(), "linears": [x.to_json() for x in self.linears],
               "adjusted_blocks": [x.to_json() for x in self.adjusted_blocks],
               "tables": {name: t.to_json() for name, t in self.tables.items()},
               "estimated_bytes": self.estimated_bytes}
        if self.towers:
            out["towers"] = {name: t.to_json() for name, t in self.towers.items()}
        if self.prequantized is not None:
            out["prequantized"] = self.prequantized.to_json()
        if self.memory is not None:
            out["memory"] = self.memory.to_json()
        if self.budget is not None:
            out["budget"] = self.budget.to_json()
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
    #: the reference's logit of its top-1 minus its logit of the runtime's top-1 (0 when they agree)
    ref_gap: float
    #: how far the measured errors close that gap: what the two logits involved moved
    #: (llmexport/verification/logits.py)
    noise_explains: float

    @property
    def flipped(self) -> bool:
        """A top-1 disagreement that counts: the gap between the two logits involved is more than
        their movements explain (within them, the step is a near-tie the measured errors flipped;
        the bounds judge those errors)."""
        return not self.top1_match and self.ref_gap > self.noise_explains


@dataclass(frozen=True)
class LogitSummary(_PlainFields):
    """Teacher-forced logits of a run against a reference: the numbers over all steps."""

    top1_agreement: float
    max_abs_err: float
    mean_abs_err: float


@dataclass(frozen=True)
class LogitStats(LogitSummary):
    """Teacher-forced logits of a run against a reference, over all steps and step by step."""

    per_step: tuple[StepStats, ...]

    def summary(self) -> LogitSummary:
        """The numbers over all steps, without the steps (as reports print them against fp32 HF)."""
        return LogitSummary(self.top1_agreement, self.max_abs_err, self.mean_abs_err)

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
    """The runtime's tokenizer against HF's on the sample texts and the prompt.

    ``ignore_merges``: with ``--approximate_ignore_merges``, the accepted difference measured at
    export (llmexport/mnn/tokenizer/whole_words.py) and ``approximated``: the samples on which the
    runtime gives HF's ids without the whole-word lookup (not counted as mismatches)."""

    agree: bool
    cases: int
    mismatches: tuple[str, ...]
    ignore_merges: Mapping[str, Any] | None = None
    approximated: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TokenizerCheck:
        return cls(data["agree"], data["cases"], tuple(data["mismatches"]), data.get("ignore_merges_approximation"),
                   tuple(data.get("approximated", ())))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"agree": self.agree, "cases": self.cases, "mismatches": list(self.mismatches)}
        if self.ignore_merges is not None:
            out["ignore_merges_approximation"] = dict(self.ignore_merges)
            out["approximated"] = list(self.approximated)
        return out


@dataclass(frozen=True)
class Bounds(_PlainFields):
    """Pass criteria against the stored-weights oracle, for the runtime profile an export ships
    (chosen by llmexport.verification.verify.bounds_for_export, calibrated in docs/verification.md).

    ``max_abs_err`` / ``mean_abs_err`` bound the run with the shipped config.json;
    ``kernels_max_abs_err`` bounds the run on MNN's exact kernels that a fast export with
    quantized linears also gets (that run proves the graph and the records).
    """

    profile: str
    max_abs_err: float
    mean_abs_err: float | None = None
    kernels_max_abs_err: float | None = None

    @property
    def exact_kernels_max_abs_err(self) -> float:
        """The bound of a run on MNN's exact kernels (the media prompts run there, whatever ships)."""
        return self.max_abs_err if self.kernels_max_abs_err is None else self.kernels_max_abs_err


@dataclass(frozen=True)
class ConversationTurn:
    """One chat turn of the conversation check (docs/verification.md#conversations), run in one
    runtime instance that keeps its KV cache between turns.

    ``prompt_tokens``: the HF rendering of the whole history (the checkpoint's chat template);
    ``kept_tokens``: what the runtime kept of its cache from earlier turns, ``prefilled_tokens``:
    what it prefilled for this turn; ``past_window``: the kept history is longer than the sliding
    window; ``prompt_mismatch_at``: the first position where the runtime's own rendering and
    tokenization of the history differs from HF's (None: equal); ``streamed_text``: what the
    runtime streams for its answer; ``decoded_text``: HF's ``decode(answer, skip_special_tokens=True)``
    of the same ids; ``text_difference``: the kinds of a difference between the two
    (llmexport.mnn.tokenizer.stream: known ones, or ``unexplained``; empty when equal);
    ``oracle``: greedy answers (the stored-weights oracle's, the runtime's) and the teacher-forced
    statistics on the oracle's answer; ``fp32``: the same run against the fp32 HF model;
    ``exact_kernels``: the exact-kernels run of a fast export with quantized linears.
    """

    conversation: int
    turn: int
    prompt_tokens: int
    kept_tokens: int
    prefilled_tokens: int
    past_window: bool
    prompt_mismatch_at: int | None
    streamed_text: str
    decoded_text: str
    text_difference: tuple[str, ...]
    oracle: RunComparison
    fp32: LogitStats
    exact_kernels: RunComparison | None = None

    _PLAIN = ("conversation", "turn", "prompt_tokens", "kept_tokens", "prefilled_tokens", "past_window")

    @property
    def prompt_ids_match(self) -> bool:
        return self.prompt_mismatch_at is None

    @property
    def text_match(self) -> bool:
        return self.streamed_text == self.decoded_text

    @property
    def label(self) -> str:
        """How failures name the turn (1-based, as a person counts them)."""
        return f"conversation {self.conversation + 1} turn {self.turn + 1}"

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ConversationTurn:
        kernels = data.get("exact_kernels")
        turn = cls(**{k: data[k] for k in cls._PLAIN}, prompt_mismatch_at=data["prompt_mismatch_at"],
                   streamed_text=data["streamed_text"], decoded_text=data["decoded_text"],
                   text_difference=tuple(data["text_difference"]),
                   oracle=RunComparison.from_json(data["oracle"]), fp32=LogitStats.from_json(data["fp32"]),
                   exact_kernels=None if kernels is None else RunComparison.from_json(kernels))
        for key in ("prompt_ids_match", "text_match"):
            if getattr(turn, key) != data[key]:
                raise ValueError(f"{turn.label}: {key}={data[key]} contradicts the recorded ids/texts")
        return turn

    def to_json(self) -> dict[str, Any]:
        out = {**{k: getattr(self, k) for k in self._PLAIN}, "prompt_ids_match": self.prompt_ids_match,
               "prompt_mismatch_at": self.prompt_mismatch_at, "text_match": self.text_match,
               "streamed_text": self.streamed_text, "decoded_text": self.decoded_text,
               "text_difference": list(self.text_difference), "oracle": self.oracle.to_json()}
        if self.exact_kernels is not None:
            out["exact_kernels"] = self.exact_kernels.to_json()
        out["fp32"] = self.fp32.to_json()
        return out


@dataclass(frozen=True)
class ConversationCheck:
    """The conversation check: turns of several conversations in one runtime instance, with a
    ``reset()`` between conversations; ``runtime_error``: why the runtime stopped before
    ``planned_turns`` turns (then the next turn is the one that failed)."""

    sliding_window: int
    planned_turns: int
    turns: tuple[ConversationTurn, ...]
    runtime_error: str | None = None

    @property
    def top1_agreement(self) -> float:
        """Over every teacher-forced step of every turn (the shipped run)."""
        steps = [s for t in self.turns for s in t.oracle.per_step]
        return sum(s.top1_match for s in steps) / len(steps) if steps else 0.0

    @property
    def max_abs_err(self) -> float:
        return max((t.oracle.max_abs_err for t in self.turns), default=0.0)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ConversationCheck:
        return cls(data["sliding_window"], data["planned_turns"],
                   tuple(ConversationTurn.from_json(t) for t in data["turns"]), data["runtime_error"])

    def to_json(self) -> dict[str, Any]:
        return {"sliding_window": self.sliding_window, "planned_turns": self.planned_turns,
                "runtime_error": self.runtime_error, "top1_agreement": self.top1_agreement,
                "max_abs_err": self.max_abs_err, "turns": [t.to_json() for t in self.turns]}


@dataclass(frozen=True)
class MediaPromptReport:
    """One media prompt through MNN's runtime against HF's full model on it
    (llmexport/verification/media.py).

    ``ids_match``: the runtime's prompt ids are HF's processor's; ``greedy_ref`` / ``greedy_mnn``:
    each side's greedy tokens, through the first media token (``stopped_at_media_token``: that ended
    them); ``forced``: the runtime's teacher-forced logits against HF carrying the stored weights and
    ``fp32`` against the fp32 HF, when the ids match; ``bos_count``: BOS tokens in the runtime's
    prompt; ``label``: the prompt's, ``info``: its own fields (``PromptCase.info``), written last.
    """

    prompt_tokens: int
    ids_match: bool
    greedy_ref: tuple[int, ...]
    greedy_mnn: tuple[int, ...]
    failures: tuple[str, ...]
    forced: LogitStats | None = None
    fp32: LogitSummary | None = None
    label: str = ""
    stopped_at_media_token: bool = False
    bos_count: int = 1
    info: Mapping[str, Any] = field(default_factory=dict)

    _OWN = ("prompt_tokens", "ids_match", "greedy_ref", "greedy_mnn", "greedy_match", "forced", "fp32", "failures",
            "label", "stopped_at_media_token", "bos_count")

    @property
    def greedy_match(self) -> bool:
        return self.greedy_ref == self.greedy_mnn

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MediaPromptReport:
        forced, fp32 = data.get("forced"), data.get("fp32")
        report = cls(data["prompt_tokens"], data["ids_match"], tuple(data["greedy_ref"]), tuple(data["greedy_mnn"]),
                     tuple(data["failures"]), None if forced is None else LogitStats.from_json(forced),
                     None if fp32 is None else LogitSummary.from_json(fp32), data["label"],
                     data["stopped_at_media_token"], data["bos_count"],
                     {k: v for k, v in data.items() if k not in cls._OWN})
        if report.greedy_match != data["greedy_match"]:
            raise ValueError(f"media prompt {report.label}: greedy_match={data['greedy_match']} with greedy ids "
                             f"{data['greedy_ref']} vs {data['greedy_mnn']}")
        return report

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"prompt_tokens": self.prompt_tokens, "ids_match": self.ids_match,
                               "greedy_ref": list(self.greedy_ref), "greedy_mnn": list(self.greedy_mnn),
                               "greedy_match": self.greedy_match}
        if self.forced is not None:
            out["forced"] = self.forced.to_json()
        if self.fp32 is not None:
            out["fp32"] = self.fp32.to_json()
        out.update(failures=list(self.failures), label=self.label, stopped_at_media_token=self.stopped_at_media_token,
                   bos_count=self.bos_count)
        out.update(self.info)
        return out


@dataclass(frozen=True)
class TowerReport:
    """One tower's section of ``verify.json`` (llmexport/verification/towers.py), ``passed`` when
    nothing failed: the tower graph alone on each case of its ``TowerCheck`` against HF's features
    (``cases``, written under ``cases_key``: each case's own fields, then its measures, as the
    check names them), and its media prompts; ``notes``: the check's fields, reported as they are;
    ``conversation``: the chat whose first turn carries the medium, then text turns
    (llmexport/verification/media_chat.py), or why it was skipped ("skipped: ..."); None: not run.
    """

    failures: tuple[str, ...]
    feature_bound: float
    cases_key: str
    cases: tuple[Mapping[str, Any], ...]
    prompts: tuple[MediaPromptReport, ...] = ()
    notes: Mapping[str, Any] = field(default_factory=dict)
    conversation: ConversationCheck | str | None = None

    @property
    def passed(self) -> bool:
        return not self.failures

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TowerReport:
        """The section's keys in their written order: passed, failures, the notes, feature_bound,
        the cases' key, prompts, conversation (absent from reports written before it was checked)."""
        keys = list(data)
        bound = keys.index("feature_bound") if "feature_bound" in keys else -1
        if keys[:2] != ["passed", "failures"] or bound < 2 or keys[bound + 2:] not in (["prompts"],
                                                                                        ["prompts", "conversation"]):
            raise ValueError(f"tower section: keys {keys}, expected passed, failures, notes, feature_bound, "
                             "the cases, prompts, conversation")
        cases_key = keys[bound + 1]
        chat = data.get("conversation")
        report = cls(tuple(data["failures"]), data["feature_bound"], cases_key, tuple(data[cases_key]),
                     tuple(MediaPromptReport.from_json(p) for p in data["prompts"]),
                     {k: data[k] for k in keys[2:bound]},
                     ConversationCheck.from_json(chat) if isinstance(chat, dict) else chat)
        if report.passed != data["passed"]:
            raise ValueError(f"tower section: passed={data['passed']} with {len(report.failures)} failure(s)")
        return report

    def to_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "failures": list(self.failures), **self.notes,
                "feature_bound": self.feature_bound, self.cases_key: [dict(case) for case in self.cases],
                "prompts": [p.to_json() for p in self.prompts],
                "conversation": (self.conversation.to_json() if isinstance(self.conversation, ConversationCheck)
                                 else self.conversation)}


@dataclass(frozen=True)
class ArmPrecision:
    """``--verify_arm`` at one precision: the single prompt teacher-forced along the same ids as on
    this host, against the stored-weights oracle (``oracle``) and fp32 HF, its largest difference from
    this host's run, the conversation, and what the verification's rules say of it at ``bound``
    (``failures``: ``normal``'s always fail the export, ``low``'s where it is shipped;
    llmexport/verification/arm.py)."""

    precision: str
    shipped: bool
    oracle: RunComparison
    fp32: LogitStats
    vs_host_max_abs_err: float
    conversation: ConversationCheck
    failures: tuple[str, ...]
    bound: float

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ArmPrecision:
        return cls(data["precision"], data["shipped"], RunComparison.from_json(data["oracle"]),
                   LogitStats.from_json(data["fp32"]), data["vs_host_max_abs_err"],
                   ConversationCheck.from_json(data["conversation"]), tuple(data["failures"]), data["bound"])

    def to_json(self) -> dict[str, Any]:
        return {"precision": self.precision, "shipped": self.shipped, "oracle": self.oracle.to_json(),
                "fp32": self.fp32.to_json(), "vs_host_max_abs_err": self.vs_host_max_abs_err,
                "conversation": self.conversation.to_json(), "failures": list(self.failures), "bound": self.bound}


@dataclass(frozen=True)
class ArmCheck:
    """``--verify_arm``: where MNN's ARM kernels ran, the kernels MNN reported, each precision's run."""

    machine: str
    kernels: Mapping[str, int]  # MNN's "The device supports" line: i8sdot, fp16, i8mm, sve2, sme2
    runs: tuple[ArmPrecision, ...]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ArmCheck:
        return cls(data["machine"], dict(data["kernels"]), tuple(ArmPrecision.from_json(r) for r in data["runs"]))

    def to_json(self) -> dict[str, Any]:
        return {"machine": self.machine, "kernels": dict(self.kernels), "runs": [r.to_json() for r in self.runs]}


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
    towers: Mapping[str, TowerReport] = field(default_factory=dict)
    prequantized: dict[str, Any] | None = None
    exact_kernels: RunComparison | None = None
    conversation: ConversationCheck | None = None
    #: checks left out, each with why (the exact-kernels runs where they do not fit in memory)
    skipped: tuple[str, ...] = ()
    #: the runtime against HF fp32 on the verification's steps, llama.cpp's numbers (KLD, top-1)
    fp32_quality: QualityStats | None = None
    #: ``--verify_text``: its file, and the runtime against HF fp32 on windows of it
    text_quality: tuple[str, QualityStats] | None = None
    #: ``--verify_arm``: the runtime side again on MNN's ARM kernels
    arm: ArmCheck | None = None

    @property
    def passed(self) -> bool:
        return not self.failures

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> VerifyReport:
        report = cls(data["prompt_tokens"], data["steps"], TokenizerCheck.from_json(data["tokenizer"]),
                     RuntimeProfile(data["runtime_profile"]), RunComparison.from_json(data["oracle"]),
                     LogitStats.from_json(data["fp32"]), Bounds.from_json(data["bounds"]), tuple(data["failures"]),
                     {name: TowerReport.from_json(t) for name, t in data["towers"].items()}, data.get("prequantized"),
                     None if "exact_kernels" not in data else RunComparison.from_json(data["exact_kernels"]),
                     None if "conversation" not in data else ConversationCheck.from_json(data["conversation"]),
                     tuple(data.get("skipped", ())),
                     None if "fp32_quality" not in data else QualityStats.from_json(data["fp32_quality"]),
                     None if "text_quality" not in data else (data["text_quality"]["file"],
                                                              QualityStats.from_json(data["text_quality"])),
                     None if "arm" not in data else ArmCheck.from_json(data["arm"]))
        if report.passed != data["passed"]:
            raise ValueError(f"verification report: passed={data['passed']} with {len(report.failures)} failure(s)")
        return report

    @classmethod
    def read(cls, path: str | Path) -> VerifyReport:
        """A ``verify.json`` written by ``--verify``; one that records a verification that could not
        run (``"ran": false``) is refused with its reason."""
        data = json.loads(Path(path).read_text())
        if data.get("ran") is False:
            raise ValueError(f"{path}: the verification did not run: {data.get('error')}")
        return cls.from_json(data)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens, "steps": self.steps, "tokenizer": self.tokenizer.to_json(),
            "runtime_profile": self.runtime_profile.value, "oracle": self.oracle.to_json(),
            "fp32": self.fp32.to_json(), "towers": {name: t.to_json() for name, t in self.towers.items()}}
        if self.prequantized is not None:
            out["prequantized"] = self.prequantized
        if self.exact_kernels is not None:
            out["exact_kernels"] = self.exact_kernels.to_json()
        if self.conversation is not None:
            out["conversation"] = self.conversation.to_json()
        if self.skipped:
            out["skipped"] = list(self.skipped)
        if self.fp32_quality is not None:
            out["fp32_quality"] = self.fp32_quality.to_json()
        if self.text_quality is not None:
            out["text_quality"] = {"file": self.text_quality[0], **self.text_quality[1].to_json()}
        if self.arm is not None:
            out["arm"] = self.arm.to_json()
        out.update(bounds=self.bounds.to_json(), failures=list(self.failures), passed=self.passed)
        return out


# --- the export ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExportResult:
    """An export: its folder, the files in it, the plan it followed, seconds per stage, and the
    verification report when ``verify`` was asked; ``verify_error``: why verification could not
    run (the export is complete and kept; ``verify.json`` records the same)."""

    dst: Path
    files: tuple[str, ...]
    plan: ExportPlan
    timings: dict[str, float] = field(default_factory=dict)
    verification: VerifyReport | None = None
    verify_error: str | None = None
