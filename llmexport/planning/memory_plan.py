"""Expected peak resident memory of an export and of its verification, from the plan.

Every figure is an upper bound calibrated on measured peaks: the resident memory of the export's
process tree, sampled every 10 ms (``bench/memory.py``; MNN 3.6.1, torch 2.13, a 2-core x86
machine, so 2 quantization workers; docs/memory.md has the table). ``--quant_bit 4 --embed_bit 4``
unless said; measured -> estimated, MiB:

  tiny checkpoints (vocab 512)              322-367 -> 553-562  (llama 367, qwen3_moe 323, k2 322, gemma4 328;
                                            llama 491-495 on fresh installs of the same pins, 2026-12-06:
                                            BASE has 10% over it)
  E2B-shaped, 4 layers, vocab 32768         682 -> 968 (tables stage); --hqq 818 -> 1048
  E2B-shaped, 12 layers (/work/ckpt/e2b-12) 1248 -> 1516; --quant_bit 16: 1207 (3124 before fp16 records
                                            were written a row slice at a time) -> 1516
  E2B-shaped, 35 layers                     1244 -> 1562
  E4B-shaped, 4 layers                      1767 -> 2026
  E4B-shaped, 42 layers (13.9 GiB)          1830 -> 2102  (issue 23 reported 1.83 GiB)
  --export onnx, E2B-shaped 2 / 4 layers, vocab 32768 (124.5M / 194.2M linear weights), tiny llama:
                                            2328 / 3484 / 344 -> 2785 / 4040 / 547

What is held at once (llmexport/targets/mnn_target.py and the writers it calls):

* the process (``_process_bytes``): interpreter, torch, transformers, onnx, MNN and the
  converter's child (``BASE``), the tokenizer converted in memory (``PER_VOCAB``, about 100 MiB
  at 262,144 ids) and the traced graph with its MNN JSON (``PER_LAYER``): 470-490 MiB before
  the weights stage at 4-35 layers, 550 MiB at 42;
* the weights stage (mnn/rebuild.py, mnn/weights.py): one linear as read from the checkpoint
  (a tied 262,144-row lm_head: 768 MiB in bf16 at E2B's width, 1280 MiB at E4B's) while the
  next one is read ahead, and a row slice in work on each quantization worker
  (quant/workers.py; ``SLICE_BYTES_PER_VALUE``: HQQ iterates in fp32 on its slice);
* the tables stage (mnn/embeddings.py, mnn/token_table.py): a 64 MiB fp32 chunk of the token
  table in work, on top of the freed heap that glibc keeps for reuse (quant/workers.py sets
  ``M_TRIM_THRESHOLD`` to 512 MiB: after the weights stage the process stays at 780-950 MiB);
* ``--lora_path``: the merge's float64 row block where a merged tensor is read (``MERGE_WORK_BYTES``,
  128 MiB, llmexport/source/lora/merge.py), in the export and in the reference;
* ``--export onnx``: every linear bound to the graph as an fp32 copy, and torch.onnx's
  serialized model beside it: 16.6-16.7 bytes per weight measured (``ONNX_BYTES_PER_WEIGHT``).

``--verify`` runs in the export's process after the export (what that still holds: at most the
process and the kept heap), with the two streamed HF references (llmexport.reference.streamed:
their small parameters between calls, a block and the logits during one) and MNN's runtime in a
child process (llmexport/mnn/runtime.py) beside them, one runtime at a time (``runtime_bytes``).
The runtime dequantizes every linear to fp32 at load on its exact kernels (fp16 records are widened
the same way on every profile); the exact-kernels run of a fast quantized export is optional:
verification skips it where it does not fit, and says so (``MemoryPlan.exact_kernels_bytes``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from llmexport.errors import ResourceError
from llmexport.mnn.config import RuntimeProfile
from llmexport.models.base import Architecture
from llmexport.options import ExportOptions
from llmexport.quant.gptq import ROW_ELEMENTS
from llmexport.quant.scheme import QuantMethod
from llmexport.quant.workers import worker_count
from llmexport.reference.streamed import reference_footprint
from llmexport.results import ExportPlan, MemoryPlan
from llmexport.source.lora.merge import MERGE_WORK_BYTES
from llmexport.spec import LinearRole

MIB, GIB = 1 << 20, 1 << 30
BASE = 544 * MIB
PER_VOCAB = 512
PER_LAYER = 2 * MIB
SLICE_VALUES = 1 << 20  # values one quantization worker takes at a time (mnn/weights.py, mnn/embeddings.py)
#: working bytes per value of the slice on each quantization worker (RTN works in cache-sized tiles)
SLICE_BYTES_PER_VALUE = {QuantMethod.RTN: 8, QuantMethod.STORED: 8, QuantMethod.HQQ: 48}
TABLE_CHUNK = 64 * MIB  # fp32 rows of the token table in work (mnn/token_table.py)
KEPT_HEAP = 512 * MIB  # glibc's M_TRIM_THRESHOLD as quant/workers.py sets it
ONNX_BYTES_PER_WEIGHT = 18
#: calibration: Hessians alive at once (a block's linears: q, k, v, o, gate, up, down and one more; all
#: but the widest-input one, down_proj, about hidden x hidden),
#: copies of the calibration tokens' activations at the widest layer (the block's input, residual,
#: attention, MLP intermediates, twice for the second run), GPTQ's copies of a row group
HESSIANS_PER_BLOCK = 8
CALIBRATION_ACTIVATIONS = 12
GPTQ_COPIES = 4
#: per weight of the largest linear, beside its fp32 parameter in the reference block: the export's
#: weight as read (bf16) and in fp32 to compare and round, GPTQ's levels per row group, their
#: concatenation and the saved copy (int8 each)
CALIBRATION_BYTES_PER_WEIGHT = 10
#: MNN's runtime child as verification runs it (520-token prompt, measured with bench/memory.py
#: --runtime): on its exact kernels (``memory: normal``) every linear is dequantized to fp32 at load,
#: beside the weight file it read: E4B-shaped 42 layers at 4 bits (4665M linear weights,
#: llm.mnn.weight 2.5 GiB) 20.5 GiB, E2B-shaped 12 layers (1054M, 0.57 GiB) 5.65 GiB, tiny (vocab
#: 512) 44 MiB. The fast kernels keep the integers: 4.05, 1.27 GiB and 38 MiB, about 1.5x the weight
#: file. Both grow with the vocabulary besides (a base per token id, fitted on the two 262,144-id ones).
RUNTIME_BASE = 64 * MIB
EXACT_BYTES_PER_WEIGHT = 4
EXACT_BYTES_PER_ID = 5 << 10
FAST_FILE_FACTOR = 1.5
FAST_BYTES_PER_ID = 1600


def memory_plan(arch: Architecture, options: ExportOptions, plan: ExportPlan, weight_file: int,
                target: PlannedTarget) -> MemoryPlan:
    """The plan's peaks; ``weight_file``: the bytes of its linear records (llm.mnn.weight);
    ``target``: the output target, which knows its own export's peak and whether it is verified."""
    export = target.export_peak_bytes(arch, plan)
    if options.calibration is not None:  # the calibration runs first, and frees its reference before writing
        export = max(export, calibration_peak_bytes(arch, options, plan))
    merge = MERGE_WORK_BYTES if options.lora is not None else 0  # a LoRA merge's float64 block, where read
    export += merge
    if not (options.verify and target.verifiable):
        return MemoryPlan(export)
    kept = min(export, _process_bytes(plan) + KEPT_HEAP)  # what the process still holds after the export
    reference = reference_footprint(arch, options.trust_remote_code)
    quantized = any(linear.bits < 16 for linear in plan.linears)
    # the runtime runs beside the idle references; the exact-kernels run of a fast quantized export
    # is optional (verification skips it, and says so, where it does not fit)
    fast = quantized and options.runtime_profile is RuntimeProfile.FAST
    shipped = plan_runtime_bytes(plan, weight_file, exact=not fast)
    exact = plan_runtime_bytes(plan, weight_file, exact=True) if fast else None
    return MemoryPlan(export, kept + max(reference.peak + merge, reference.idle + shipped),
                      None if exact is None else kept + reference.idle + exact)


def calibration_peak_bytes(arch: Architecture, options: ExportOptions, plan: ExportPlan) -> int:
    """``--calib_data`` at its peak (llmexport/calibration/gptq.py): one streamed fp32 reference (its
    residents and largest block), the Hessians of one block's linears in fp64 (the widest input's,
    the others at the hidden width), the activations of
    every calibration token at the widest layer, GPTQ's working copies of a row group, and the
    copies and levels of the largest linear being rounded."""
    assert options.calibration is not None
    reference = reference_footprint(arch, options.trust_remote_code)
    widest = max((max(linear.in_features, linear.out_features) for linear in plan.linears
                  if linear.role is not LinearRole.LM_HEAD), default=0)
    widest_input = max((linear.in_features for linear in plan.linears), default=0)
    hidden = plan.architecture.hidden_size
    tokens = options.calibration.samples * options.calibration.seq_len
    largest = max((linear.out_features * linear.in_features for linear in plan.linears), default=0)
    hessians = (widest_input ** 2 + (HESSIANS_PER_BLOCK - 1) * hidden ** 2) * 8
    return (BASE + reference.resident + reference.largest_block + hessians
            + CALIBRATION_ACTIVATIONS * tokens * widest * 4 + GPTQ_COPIES * ROW_ELEMENTS * 4
            + CALIBRATION_BYTES_PER_WEIGHT * largest)


class PlannedTarget(Protocol):
    """What the memory plan asks of an output target (llmexport/targets/base.py)."""

    verifiable: bool

    def export_peak_bytes(self, arch: Architecture, plan: ExportPlan) -> int: ...


def onnx_export_peak_bytes(plan: ExportPlan) -> int:
    """``--export onnx`` at its peak: every linear bound to the graph as an fp32 copy, serialized beside it."""
    return BASE + ONNX_BYTES_PER_WEIGHT * _linear_weights(plan)


def mnn_export_peak_bytes(arch: Architecture, plan: ExportPlan) -> int:
    """The MNN export's process (and the converter's child beside it) at its peak."""
    read = sorted((_source_bytes(arch, linear.name, linear.out_features * linear.in_features)
                   for linear in plan.linears), reverse=True)
    largest = max((linear.out_features * linear.in_features for linear in plan.linears), default=0)
    per_value = max((SLICE_BYTES_PER_VALUE[linear.method] for linear in plan.linears), default=0)
    work = worker_count() * min(SLICE_VALUES, largest) * per_value
    table = sum(4 * t.rows * t.dim for t in plan.tables.values())
    return _process_bytes(plan) + work + max(sum(read[:2]), min(table, KEPT_HEAP) + min(table, TABLE_CHUNK))


def runtime_bytes(weights: int, weight_file: int, vocab: int, exact: bool, head_as_table: int = 0) -> int:
    """MNN's runtime child on an export of ``weights`` linear weights in ``weight_file`` bytes with a
    ``vocab``-id vocabulary, on its exact kernels (fp16 records are widened the same way on every
    profile) or its fast ones. ``head_as_table``: the lm_head's weights where the runtime also reads
    its token embedding from that record (a tied model without a token-table file): on the exact
    kernels they are counted twice. Measured: a 4-layer 31B-shaped export (3.38G linear weights, the
    head 1.41G of them, no table file) crashed on the exact kernels at 18.1 GiB, above the 15.7 GiB
    the formula gave without that term; the E4B-shaped export, which has a table file, measured
    20.46 GiB against 21.2."""
    if exact:
        return (RUNTIME_BASE + EXACT_BYTES_PER_ID * vocab + EXACT_BYTES_PER_WEIGHT * (weights + head_as_table)
                + weight_file)
    return RUNTIME_BASE + FAST_BYTES_PER_ID * vocab + int(FAST_FILE_FACTOR * weight_file)


def plan_runtime_bytes(plan: ExportPlan, weight_file: int, exact: bool) -> int:
    """``runtime_bytes`` of a planned export whose linear records take ``weight_file`` bytes (the
    lm_head counted as a table where the plan writes no token-table file)."""
    head = 0 if plan.tables else sum(linear.out_features * linear.in_features for linear in plan.linears
                                     if linear.role is LinearRole.LM_HEAD)
    return runtime_bytes(_linear_weights(plan), weight_file, plan.architecture.vocab_size, exact, head)


def _process_bytes(plan: ExportPlan) -> int:
    """The export's process before its weights: libraries, tokenizer, graph."""
    return BASE + PER_VOCAB * plan.architecture.vocab_size + PER_LAYER * plan.architecture.layers


def _linear_weights(plan: ExportPlan) -> int:
    return sum(linear.out_features * linear.in_features for linear in plan.linears)


def _source_bytes(arch: Architecture, name: str, values: int) -> int:
    """Bytes of one linear as read from the checkpoint (a pre-quantized one, MLX, GPTQ or AWQ: dequantized, fp32)."""
    try:
        dtype = arch.checkpoint.weights.dtype(arch.linear_source(name).weight)
    except NotImplementedError:
        return 4 * values
    return dtype.itemsize * values


# --- the check -------------------------------------------------------------------------------------
def memory_limit(max_memory: float | None) -> tuple[int, str]:
    """The memory an export may use, and where that figure comes from."""
    if max_memory is not None:
        return int(max_memory * GIB), "allowed by --max_memory"
    return available_bytes(), "available"


def available_bytes() -> int:
    """Memory available to this process now: the machine's (psutil), or less under the memory
    limit of the cgroup (v2) this process runs in, as a container sets it."""
    import psutil

    available = int(psutil.virtual_memory().available)
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            available = min(available, int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return max(0, available)


def refusal(memory: MemoryPlan, limit: int, label: str) -> str | None:
    """Why an export with this plan would be refused under ``limit`` bytes; None when it fits."""
    if memory.export_bytes > limit:
        what, advice = f"the export needs about {gib(memory.export_bytes)}", "free memory or run on a larger machine"
    elif memory.verify_bytes is not None and memory.verify_bytes > limit:
        what, advice = f"--verify needs about {gib(memory.verify_bytes)}", "run without --verify or on a larger machine"
    else:
        return None
    return f"{what} of memory, {gib(limit)} {label}; {advice} (--max_memory GIB overrides the check)"


def check_fits(memory: MemoryPlan, max_memory: float | None) -> None:
    """Refuse, before any heavy stage, an export or verification that would not fit in memory."""
    reason = refusal(memory, *memory_limit(max_memory))
    if reason is not None:
        raise ResourceError(reason)


def gib(value: int) -> str:
    return f"{value / GIB:.1f} GiB"


def summary_line(memory: MemoryPlan) -> str:
    """The plan's expected peaks, as ``--dry-run`` prints them."""
    verify = "" if memory.verify_bytes is None else f", --verify {gib(memory.verify_bytes)}"
    exact = "" if memory.exact_kernels_bytes is None else \
        f" (its run on MNN's exact kernels {gib(memory.exact_kernels_bytes)}, skipped where it does not fit)"
    return f"expected peak memory: export {gib(memory.export_bytes)}{verify}{exact}"


def fit_line(memory: MemoryPlan, max_memory: float | None) -> str:
    """Whether the planned export fits here (``--dry-run``): the limit and the verdict."""
    limit, label = memory_limit(max_memory)
    reason = refusal(memory, limit, label)
    skipped = memory.exact_kernels_bytes is not None and memory.exact_kernels_bytes > limit
    return f"memory: {gib(limit)} {label}; " + ("fits" if reason is None else f"would be refused: {reason}") + \
        ("; --verify would skip its exact-kernels run" if reason is None and skipped else "")


def exact_kernels_refusal(weights: int, weight_file: int, vocab: int, head_as_table: int = 0) -> str | None:
    """Why verification skips an export's run on MNN's exact kernels here (None: it fits)."""
    need, free = runtime_bytes(weights, weight_file, vocab, exact=True, head_as_table=head_as_table), available_bytes()
    if need <= free:
        return None
    return (f"needs about {gib(need)} of memory (MNN's runtime dequantizes every linear to fp32 at load), "
            f"{gib(free)} available")

