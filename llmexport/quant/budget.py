"""A size budget instead of a recipe (``--target_bpw``): each linear's scheme chosen by sensitivity per byte.

**What the budget counts.** Bits per weight = 8 x the bytes of the text graph's linear records in
``llm.mnn.weight`` (header, value map, packed levels, scales and zeros, bias; lm_head included,
tied or not, and routers at whatever they are written with) / the number of weights of those
linears. The embedding and PLE tables (``--embed_bit``: one width for a whole table, read with one
block by the runtime) and the towers' records are not counted and not chosen here.

**Candidates.** Each linear starts at the command line's scheme (``--quant_bit``/``--quant_block``,
its ``sym`` and method: the smallest rung) and may be upgraded to the same bits at a smaller block
(``SMALL_BLOCK``), or to 4 and 8 bits at the command line's block; larger bits than the base only.
What is not a candidate (routers, linears without a score) keeps the scheme it would have had and
still counts in the budget.

**Allocation.** Every rung of every linear has an estimated loss (llmexport.sensitivity: an output
error proxy, lower is better) and a byte count. Per linear only the rungs on the lower convex hull
of (bytes, loss) are steps worth taking, each with a gain per extra byte that falls along the hull.
All linears' steps are merged into one order, highest gain per byte first (ties: the graph's
order of the linears, then the step's order), which does not depend on the budget. The steps are
taken in that order while they fit; a step that does not fit is passed over, and so are its
linear's later steps (they start from the rung it would have reached), while other linears'
smaller steps may still fit. The estimated total loss never rises with the budget: up to the first
step that fits a larger budget but not a smaller one, both take the same steps; from there the
smaller one gains at most that step's gain per byte times what it has left, which is less than
the step itself gains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from llmexport.quant.scheme import FP16_BITS, QuantScheme

#: the intermediate rung: the base bits with blocks of 32 (finer scales at 1/block of a bit per scale)
SMALL_BLOCK = 32
#: the widest rung: 8 bits keep ~ 1/256 of the 4-bit rounding error at less than twice its bytes
UPGRADE_BITS = (4, 8)


class BudgetError(ValueError):
    """A budget no allocation can meet (the message says the smallest one that can)."""


def candidate_schemes(base: QuantScheme) -> tuple[QuantScheme, ...]:
    """The rungs a linear whose base scheme is ``base`` may take, smallest first (module docstring)."""
    if base.is_fp16:
        return (base,)
    rungs = [base]
    if base.block == 0 or base.block > SMALL_BLOCK:
        rungs.append(replace(base, block=SMALL_BLOCK))
    rungs += [replace(base, bits=bits) for bits in UPGRADE_BITS if bits > base.bits]
    return tuple(rungs)


@dataclass(frozen=True)
class Rung:
    """One candidate scheme of one linear: the block it really gets (``QuantScheme.block_for``),
    its record bytes and estimated loss."""

    scheme: QuantScheme
    block: int
    bytes: int
    loss: float


@dataclass(frozen=True)
class BudgetItem:
    """One linear the budget chooses for: its rungs, the base (smallest) first."""

    name: str
    weights: int
    rungs: tuple[Rung, ...]

    def steps(self) -> list[tuple[float, int]]:
        """(gain per extra byte, rung index) along the lower convex hull from the base rung."""
        steps: list[tuple[float, int]] = []
        current = 0
        while True:
            best: tuple[float, int] | None = None
            here = self.rungs[current]
            for j in range(current + 1, len(self.rungs)):
                extra, gain = self.rungs[j].bytes - here.bytes, here.loss - self.rungs[j].loss
                if extra > 0 and gain > 0 and (best is None or gain / extra > best[0]):
                    best = (gain / extra, j)
            if best is None:
                return steps
            steps.append(best)
            current = best[1]


@dataclass(frozen=True)
class BudgetChoice:
    """What the budget gave one linear: the chosen scheme, its estimated loss at the base rung
    (``score``) and at the chosen one, and the gain per byte of its first upgrade (0: none)."""

    name: str
    bits: int
    block: int
    score: float
    loss: float
    gain_per_byte: float

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "bits": self.bits, "block": self.block, "score": self.score,
                "loss": self.loss, "gain_per_byte": self.gain_per_byte}


@dataclass(frozen=True)
class BudgetSummary:
    """The budget's decision as the plan, ``--dry-run`` and manifest.json show it: the target, the
    bits per weight reached, the smallest and largest reachable, the proxy the scores come from,
    and every linear's choice, highest first-upgrade gain per byte first."""

    target_bpw: float
    achieved_bpw: float
    min_bpw: float
    max_bpw: float
    proxy: str
    choices: tuple[BudgetChoice, ...]

    def to_json(self) -> dict[str, Any]:
        return {"target_bpw": self.target_bpw, "achieved_bpw": self.achieved_bpw, "min_bpw": self.min_bpw,
                "max_bpw": self.max_bpw, "proxy": self.proxy, "choices": [c.to_json() for c in self.choices]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BudgetSummary:
        return cls(data["target_bpw"], data["achieved_bpw"], data["min_bpw"], data["max_bpw"], data["proxy"],
                   tuple(BudgetChoice(**c) for c in data["choices"]))


def allocate(items: Sequence[BudgetItem], budget_bytes: int, fixed_bytes: int = 0) -> dict[str, int]:
    """Each item's chosen rung index under ``budget_bytes`` for all records (``fixed_bytes``: the
    records that are not items). BudgetError when even every base rung does not fit."""
    used = fixed_bytes + sum(item.rungs[0].bytes for item in items)
    if used > budget_bytes:
        raise BudgetError(f"{budget_bytes} bytes is below the smallest allocation ({used} bytes)")
    chosen = {item.name: 0 for item in items}
    frozen: set[str] = set()
    for _, index, _, rung in _order(items):
        item = items[index]
        extra = item.rungs[rung].bytes - item.rungs[chosen[item.name]].bytes
        if item.name in frozen or used + extra > budget_bytes:
            frozen.add(item.name)
            continue
        used += extra
        chosen[item.name] = rung
    return chosen


def _order(items: Sequence[BudgetItem]) -> list[tuple[float, int, int, int]]:
    """Every step of every item as (-gain per byte, item index, step index, rung), in the order taken."""
    return sorted((-ratio, index, step, rung) for index, item in enumerate(items)
                  for step, (ratio, rung) in enumerate(item.steps()))


def summarize(items: Sequence[BudgetItem], chosen: Mapping[str, int], target_bpw: float, fixed_bytes: int,
              fixed_weights: int, proxy: str) -> BudgetSummary:
    """The decision of ``allocate`` as a ``BudgetSummary`` (``fixed_*``: the records that are not items)."""
    weights = fixed_weights + sum(item.weights for item in items)

    def bpw(pick: Any) -> float:
        return 8 * (fixed_bytes + sum(item.rungs[pick(item)].bytes for item in items)) / weights

    first = {item.name: (item.steps() or [(0.0, 0)])[0][0] for item in items}
    ranked = sorted(range(len(items)), key=lambda i: (-first[items[i].name], i))
    choices = []
    for i in ranked:
        item = items[i]
        rung = item.rungs[chosen[item.name]]
        choices.append(BudgetChoice(item.name, rung.scheme.bits, rung.block,
                                    item.rungs[0].loss, rung.loss, first[item.name]))
    return BudgetSummary(target_bpw, round(bpw(lambda item: chosen[item.name]), 4), round(bpw(lambda item: 0), 4),
                         round(bpw(lambda item: len(item.rungs) - 1), 4), proxy, tuple(choices))


def budget_bytes(target_bpw: float, weights: int) -> int:
    """The bytes ``target_bpw`` bits per weight allow for ``weights`` weights."""
    return math.floor(target_bpw * weights / 8)


def check_target(target_bpw: float) -> float:
    """``target_bpw`` if it is a number of bits per weight a record can hold on average (ValueError)."""
    if not (isinstance(target_bpw, (int, float)) and 0 < target_bpw <= FP16_BITS):
        raise ValueError(f"must be a number of bits per weight in (0, {FP16_BITS}] (16 = fp16), got {target_bpw}")
    return float(target_bpw)
