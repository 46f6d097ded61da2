"""Every scheme an export writes, decided in one place for the plan (``--dry-run``) and the export.

* **text linears**: the options' default scheme, ``--quant_config`` / recipe rules (first match,
  llmexport.quant.recipes) and ``--lm_quant_bit``/``--lm_quant_block`` for lm_head; for a
  pre-quantized (MLX, GPTQ, AWQ) checkpoint, its stored integers where MNN can hold them (below); with
  ``--target_bpw``, the size budget's choice from the scheme above upwards (llmexport.calibration.size_budget);
* **tower linears**: ``--visual_quant_bit`` / ``--audio_quant_bit`` with the default's block, sym
  and method;
* **the token table**: ``--embed_bit`` (else the recipe's, else bf16) at the default's block, or
  an MLX table as stored (the embedding joined with the PLE table keeps both tables' integers in
  one table at their common group).

For an MLX-quantized checkpoint (llmexport.source.importers.mlx) the default is *as stored*: every
quantized linear and embedding table keeps MLX's integers and affine map (``QuantMethod.STORED``,
alpha in fp32), and what MLX left in floats (its predicate skips layers whose width the group does
not divide and modules without ``to_quantized``, such as K2-Horizon's routers) stays in floats:
fp16 linear records, bf16 tables. The export is then the model the user validated. A tensor is
instead dequantized (fp32) and written with the export's scheme, and the plan, manifest and
verification report list it with the reason, when

* MNN cannot hold the stored form (llmexport.mnn.limits): bits other than 2, 3, 4, 8 (MLX also has
  5 and 6), tables and a tied lm_head (which the runtime also reads as the token embedding) at
  other than 4 or 8 bits, parts joined into one linear (Gemma4's expert gate/up) or into the
  token table (the embedding and the PLE table) stored at different bits, or one quantized and
  one in floats;
* the user asked for it: ``requantize`` (``--requantize``: everything), a ``--quant_config`` rule
  or recipe rule that matches the linear, ``--lm_quant_bit``/``--lm_quant_block`` (lm_head),
  ``--embed_bit`` or a quant_config ``embed_bit`` (tables).

GPTQ and AWQ checkpoints (llmexport.source.importers.gptq_awq) follow the same rules: their linears keep
their integers (group -1 as one block per row; all zeros 2^(bits-1): a symmetric record), their
float tensors stay as stored; a linear is also dequantized and quantized afresh when its groups
are no runs of consecutive inputs (act-order's permuted ``g_idx``) or its group does not divide
its width.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, cast

from llmexport.errors import UsageError
from llmexport.mnn.limits import BLOCKS, FP16_BITS, KEPT_BLOCKS, LINEAR_BITS, QUANTIZED_TABLE_BITS
from llmexport.mnn.token_table import JoinedColumns, token_table
from llmexport.models.base import Architecture
from llmexport.options import ExportOptions
from llmexport.quant.budget import BudgetSummary
from llmexport.quant.recipes import QuantPlan
from llmexport.quant.scheme import QuantMethod, QuantScheme
from llmexport.quant.transcode import transcode
from llmexport.results import ChangedLinear, PrequantizedSummary, PrequantizedTable
from llmexport.source.importers import imported_store
from llmexport.source.importers.formats import QUANTIZED_TABLES, tables_format
from llmexport.source.importers.gguf import GgufLazy
from llmexport.source.importers.mlx import MlxLazy
from llmexport.source.lora import unmerged
from llmexport.spec import LazyRows, LinearRole, LinearSpec, PrequantizedStore, QuantInfo, common_group

#: the option that sets each tower's bits
TOWER_BITS: dict[str, Callable[[ExportOptions], int]] = {
    "visual": lambda o: o.visual_quant_bit,
    "audio": lambda o: o.audio_quant_bit,
}


@dataclass(frozen=True)
class Choice:
    """How one linear is written: its scheme, the source format, and why it is not transcoded."""

    scheme: QuantScheme
    stored: str
    reason: str | None = None  # None: kept as stored (same integers, or fp16 for a float source)


@dataclass(frozen=True)
class TableChoice:
    """How one embedding table is written: bits, block, its row chunks and rows (floats, or the
    stored integers the quantizer takes) and the quantizer."""

    bits: int
    block: int
    chunks: Callable[[], Iterable[Any]]
    rows: Callable[[int, int], Any]
    quantizer: Callable | None = None
    stored: str | None = None
    reason: str | None = None


def requested_scheme(options: ExportOptions, spec: LinearSpec) -> QuantScheme:
    """The scheme the options ask for one text linear (lm_head's own, else the first matching rule)."""
    if spec.role is LinearRole.LM_HEAD and options.lm_quant is not None:
        return options.lm_quant
    return QuantPlan(options.quant, options.rules).scheme_for(spec)


def requested_table_bits(options: ExportOptions) -> int:
    """Bits of the token table the options ask for: ``--embed_bit``, else the recipe's, else 16."""
    if options.embed_bit is not None:
        return options.embed_bit
    return options.recipe_embed_bit if options.recipe_embed_bit is not None else 16


def tower_scheme(options: ExportOptions, tower: str) -> QuantScheme:
    """Scheme of every linear of a multimodal tower ("visual", "audio")."""
    bits = TOWER_BITS[tower](options) if tower in TOWER_BITS else options.quant.bits
    return replace(options.quant, bits=bits)


class Schemes:
    """The scheme of every linear (text and towers) and table of one export (module docstring)."""

    def __init__(self, arch: Architecture, options: ExportOptions,
                 record_bytes: Callable[[LinearSpec, QuantScheme], int] | None = None):
        """``record_bytes``: the target's bytes of one linear, which ``--target_bpw`` spends."""
        self.arch, self.options = arch, options
        weights = unmerged(arch.checkpoint.weights)
        self.imported = imported_store(weights)  # an MLX, GPTQ or AWQ checkpoint's store
        self.choices: dict[str, Choice] = {}
        if self.imported is not None and not options.requantize:
            # options that change or re-round the weights: the stored integers cannot be kept
            for flag, asked, why in (
                    ("--lora_path", options.lora, "an adapter changes the weights before they are quantized"),
                    ("--calib_data", options.calibration, "calibration rounds the weights afresh"),
                    ("--target_bpw", options.target_bpw, "the budget chooses how the weights are rounded afresh")):
                if asked is not None:
                    raise UsageError(f"{flag}: this pre-quantized checkpoint keeps its stored integers; {why}, "
                                     "so it needs --requantize")
        if self.imported is not None:
            self.choices = {spec.name: self._choose(self.imported, spec) for spec in arch.linears()}
        self.budget: BudgetSummary | None = None
        self.budgeted: dict[str, QuantScheme] = {}
        if options.target_bpw is not None:
            from llmexport.calibration.size_budget import budget_schemes
            from llmexport.quant.methods import quantizers

            assert record_bytes is not None, "--target_bpw spends the target's record bytes"
            self.budget, self.budgeted = budget_schemes(arch, options, functools.partial(requested_scheme, options),
                                                        record_bytes, quantizers(options.use_gpu))

    # --- linears ---------------------------------------------------------------------------------
    def linear(self, spec: LinearSpec) -> QuantScheme:
        """The scheme of one text-graph linear."""
        if spec.name in self.budgeted:
            return self.budgeted[spec.name]
        choice = self.choices.get(spec.name)
        return choice.scheme if choice is not None else requested_scheme(self.options, spec)

    def tower(self, tower: str, spec: LinearSpec) -> QuantScheme:
        """The scheme of one linear of a tower (the same for all of a tower's linears)."""
        return tower_scheme(self.options, tower)

    def stored(self, name: str) -> bool:
        """True when a text linear keeps its checkpoint's own integers (``QuantMethod.STORED``)."""
        choice = self.choices.get(name)
        return choice is not None and choice.scheme.method is QuantMethod.STORED

    def _choose(self, store: PrequantizedStore, spec: LinearSpec) -> Choice:
        weight = self.arch.linear_source(spec.name).weight
        infos = store.quantization(weight)
        reason = self._requested(spec) or self._unfit(spec, infos)
        if reason is None:
            reason = store.unfit(weight)  # the source's own reasons (GPTQ's act-order, a GGUF type without a record)
        if reason is not None:
            return Choice(requested_scheme(self.options, spec), store.label(weight), reason)
        if infos[0] is None:  # float in the checkpoint: kept as fp16
            return Choice(QuantScheme(FP16_BITS), store.label(weight))
        info = infos[0]
        block = info.group if info.group in KEPT_BLOCKS else 0  # else one group per row (_unfit)
        return Choice(QuantScheme(info.bits, block, info.sym, QuantMethod.STORED), str(info))

    def _requested(self, spec: LinearSpec) -> str | None:
        """Why the user's options take this linear off "as stored", if they do."""
        o = self.options
        if o.requantize:
            return "requantize requested"
        rule = next((r for r in o.rules if r.matches(spec)), None)
        if rule is not None:
            return f"quant_config rule {rule.match!r}"
        if spec.role is LinearRole.LM_HEAD and o.lm_quant is not None:
            return "--lm_quant_bit/--lm_quant_block"
        return None

    def _unfit(self, spec: LinearSpec, infos: tuple[QuantInfo | None, ...]) -> str | None:
        """Why MNN cannot hold the stored integers of this linear, if it cannot."""
        if len(set(infos)) > 1:
            return "its joined parts are stored in different formats"
        info = infos[0]
        if info is None:
            return None
        if info.bits not in LINEAR_BITS:
            return f"{info.bits}-bit: MNN linears take {', '.join(map(str, LINEAR_BITS))} bits"
        if info.group not in KEPT_BLOCKS and info.group != spec.in_features:  # a whole row is block 0
            return f"group {info.group}: kept MNN blocks are {', '.join(map(str, KEPT_BLOCKS))}"
        if spec.role is LinearRole.LM_HEAD and self.arch.tied_embedding and info.bits not in QUANTIZED_TABLE_BITS:
            return f"{info.bits}-bit tied lm_head: the runtime reads it as the token embedding, at 4 or 8 bits only"
        return None

    # --- tables ----------------------------------------------------------------------------------
    def table(self, lazy: LazyRows | JoinedColumns) -> TableChoice:
        """How a token table (one checkpoint table, or ``JoinedColumns`` of the embedding and PLE
        tables) is written: an MLX table keeps its integers where one MNN table can hold them."""
        o = self.options
        bits = requested_table_bits(o)
        parts = lazy.parts if isinstance(lazy, JoinedColumns) else (lazy,)
        if self.imported is None or not all(isinstance(p, QUANTIZED_TABLES) for p in parts):
            return TableChoice(bits, o.quant.block, lazy.row_chunks, lazy.rows)
        stored = tables_format(parts)
        reason = self._table_requested() or _table_unfit(parts)
        if reason is not None:
            return TableChoice(bits, o.quant.block, lazy.row_chunks, lazy.rows, stored=stored, reason=reason)
        infos = [info for p in parts for info in p.quantization if info is not None]
        if not infos:  # float in MLX: kept as bf16
            return TableChoice(16, 0, lazy.row_chunks, lazy.rows, stored=stored)
        # MNN reads the whole table with one block: the parts' common group keeps every MLX group's
        # scale and bias (a larger group is split into runs that share them, Prequantized.regrouped)
        held = cast("MlxLazy | GgufLazy | JoinedColumns", lazy)  # every part is an importer's table (checked)
        return TableChoice(infos[0].bits, common_group(i.group for i in infos), held.quantized_chunks,
                           held.quantized_rows, transcode, stored)

    def _table_requested(self) -> str | None:
        """Why the user's options take the token table off "as stored", if they do."""
        o = self.options
        if o.requantize:
            return "requantize requested"
        if o.embed_bit is not None or o.recipe_embed_bit is not None:
            return "--embed_bit / quant_config embed_bit"
        return None

    @functools.cached_property
    def _tables(self) -> dict[str, tuple[Any, TableChoice]]:
        """``tables()``, decided once: the plan, the pre-quantized summary, the media token tail and
        the table writer all ask for it."""
        table = token_table(self.arch)
        return {} if table is None else {"embedding": (table, self.table(table))}

    def tables(self) -> dict[str, tuple[Any, TableChoice]]:
        """The table the runtime reads per token (mnn/token_table.py: the embedding of untied
        models, joined with the PLE rows where there are any) with how it is written."""
        return self._tables

    # --- report ----------------------------------------------------------------------------------
    def prequantized(self) -> PrequantizedSummary | None:
        """What keeps its stored form and what does not, with reasons (plan and manifest);
        None for a checkpoint that is not pre-quantized."""
        if self.imported is None:
            return None
        specs = {spec.name: spec for spec in self.arch.linears()}

        def changed(name: str, c: Choice) -> ChangedLinear:
            block = 0 if c.scheme.is_fp16 else c.scheme.block_for(specs[name].in_features)
            return ChangedLinear(name, c.stored, c.reason or "", c.scheme.bits, block)

        off = [changed(n, c) for n, c in self.choices.items() if c.reason is not None]
        tables = {name: PrequantizedTable(t.stored, t.bits, t.block, t.reason is None, t.reason)
                  for name, (_, t) in self.tables().items() if t.stored is not None}  # GPTQ/AWQ: float tables
        return PrequantizedSummary(
            format=self.imported.format, default="as stored", alpha=self.imported.alpha_note,
            transcoded=sum(c.scheme.method is QuantMethod.STORED for c in self.choices.values()),
            kept_float=tuple(n for n, c in self.choices.items() if c.reason is None and c.scheme.is_fp16),
            requantized=tuple(e for e in off if e.stored != "unquantized"),
            quantized_from_float=tuple(e for e in off if e.stored == "unquantized"),
            tables=tables)


def _table_unfit(parts: Iterable[MlxLazy | GgufLazy]) -> str | None:
    """Why one MNN table cannot hold the stored integers of these MLX tables (the parts of the
    token table, read side by side), if it cannot: it has one width and one block for all rows."""
    stored = [(int(p.shape[-1]), info) for p in parts for info in p.quantization]
    infos = [info for _, info in stored if info is not None]
    if not infos:
        return None
    if len(infos) < len(stored):
        return "its joined parts are stored quantized and in floats: one table has one format"
    for info in infos:
        if info.bits not in QUANTIZED_TABLE_BITS:
            return f"{info.bits}-bit: MNN 3.6.1 decodes tables at 4 or 8 bits only (else bf16)"
    if len({info.bits for info in infos}) > 1:
        return f"its joined parts are stored as {' and '.join(map(str, infos))}: one table has one width"
    for width, part in stored:  # else a block of the joined table would straddle two parts
        if part is not None and width % part.group:
            return f"width {width} is not a multiple of its group {part.group}"
    block = common_group(info.group for info in infos)
    if block not in BLOCKS[1:]:
        return f"group {block}: MNN table blocks are {', '.join(map(str, BLOCKS[1:]))}"
    return None
