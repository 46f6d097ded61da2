"""Verification: MNN's runtime on the exported folder next to the HF model.

The fair oracle is the HF model carrying exactly the weights the export stored (read back from
the exported files), so rounding and quantization never hide a wrong graph: it must agree.
The error against the unmodified fp32 HF model is reported beside it (the cost of the bits).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Iterator, Mapping, cast

import numpy as np
import torch
from torch import nn

from llmexport.calibration.data import read_texts
from llmexport.errors import InputError, UsageError, VerificationFailed
from llmexport.mnn.arm.machine import Machine
from llmexport.mnn.config import EXACT_KERNELS, LLM_WEIGHT, RuntimeProfile, profile_of
from llmexport.mnn.readback import StoredTensors
from llmexport.mnn.runtime import run_runtime, score_windows
from llmexport.mnn.tokenizer.stream import StreamModel
from llmexport.models.base import Architecture
from llmexport.options import VerifyText
from llmexport.planning.memory_plan import exact_kernels_refusal
from llmexport.reference.streamed import mapped_blocks, streamed_reference
from llmexport.results import Bounds, LogitStats, RunComparison, TokenizerCheck, TowerReport, VerifyReport
from llmexport.source.checkpoint import Checkpoint, CheckpointTensors
from llmexport.source.importers import compare_with_source
from llmexport.source.loading import open_architecture
from llmexport.verification.arm import arm_check, arm_failures, arm_summary, run_on_arm
from llmexport.verification.conversation import (
    Conversations,
    conversation_failures,
    conversation_summary,
    reference_stop_ids,
    script,
)
from llmexport.verification.logits import compare_logits, run_failures
from llmexport.verification.media import greedy_along, prompt_summary
from llmexport.verification.media_chat import media_conversation_summary
from llmexport.verification.quality import QualityStats, compare, compare_parts, windows
from llmexport.verification.towers import verify_towers

log = logging.getLogger(__name__)

TOKENIZER_SAMPLES = [
    "Hello, world! How are you today?",
    "  multiple   spaces\tand\ttabs\nnew lines\n\n",
    "Zahlen 1234567 und Umlaute: Grüße aus Köln, Straße.",
    "中文测试，混合 English 文本。",
    "emoji 🎉🚀 and symbols <>&%$#@!",
    "def f(x):\n    return x ** 2  # code",
]
_PROMPT_TEXT = ("Explain, step by step, why the sky looks blue at noon and red at sunset; "
                "antworte kurz auf Deutsch, 然后用中文总结一下。 ")


#: bounds per profile, from correct exports (docs/verification.md): fp16 records reach 7e-4; exact
#: kernels on quantized records 3.7e-3 on the tiny test models and 0.07 on a 12-layer E2B-shaped one;
#: the fast kernels up to 2.9 max / 0.27 mean on the tiny models and 4.1 / 0.61 on the E2B-shaped one
FP16_MAX_ABS_ERR = 0.005
QUANT_MAX_ABS_ERR = 0.2
FAST_MAX_ABS_ERR = 8.0
FAST_MEAN_ABS_ERR = 1.0


def bounds_for_export(stored_bits: set[int], profile: RuntimeProfile = RuntimeProfile.EXACT) -> Bounds:
    """The bounds for an export whose linear records hold ``stored_bits``, shipped with ``profile``.

    The fast profile's kernels quantize activations to 8 bits, which moves random models' logits by
    up to ~4 and flips near-ties; that noise would hide a wrong graph (measured: RMSNorm epsilons
    100x too large move the exact kernels' logits by 0.82 and the fast kernels' by 0.88, within
    their noise). So a fast export with quantized linears is also run on MNN's exact kernels, under
    ``kernels_max_abs_err``. Calibration: docs/verification.md.
    """
    if stored_bits <= {16}:
        # fp16 records: a correct graph reaches ~1e-4 and the memory mode does not touch them
        return Bounds(profile.value, FP16_MAX_ABS_ERR)
    if profile is RuntimeProfile.FAST:
        return Bounds(profile.value, FAST_MAX_ABS_ERR, FAST_MEAN_ABS_ERR, QUANT_MAX_ABS_ERR)
    return Bounds(profile.value, QUANT_MAX_ABS_ERR)


def default_prompt(tokenizer, min_tokens: int) -> list[int]:
    """A chat-templated prompt at least ``min_tokens`` long (longer than the sliding window)."""
    text = _PROMPT_TEXT
    while True:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        if len(ids) >= min_tokens:
            return ids
        text += _PROMPT_TEXT


def verify_export(export_dir: Path, model_path: Path, steps: int = 24, prompt_ids: list[int] | None = None,
                  raise_on_failure: bool = False, trust_remote_code: bool = False,
                  approximate_ignore_merges: bool = False, text: VerifyText | None = None,
                  lora: Path | None = None, arm: Machine | None = None) -> VerifyReport:
    """Verification report of ``export_dir`` against the checkpoint at ``model_path`` (also
    written to ``export_dir/verify.json``).

    The runtime runs first: its greedy continuation of the prompt with its logits at each step
    (on MNN's exact kernels when a fast export is also judged on them; the shipped profile is then
    teacher-forced on those ids). HF (the stored-weights oracle and the fp32 model) is
    teacher-forced on the same ids in one forward; its greedy ids follow its argmax along the
    runtime's (``greedy_along``): its own greedy continuation as far as they agree. Both are
    streamed references (llmexport/reference/streamed.py), so memory stays at one block of the
    model whatever its size. ``trust_remote_code`` must be True for families whose reference
    model is the checkpoint's own modeling code (``Architecture.reference_is_remote_code``).
    ``approximate_ignore_merges``: the export was made with that flag; its measured difference is
    recorded and samples the runtime encodes as HF does without the whole-word lookup do not fail.
    ``text``: windows of a user's text also scored against HF fp32 (``VerifyReport.text_quality``).
    ``lora``: the PEFT adapter the export merged; HF's references carry the same merged weights.
    ``arm``: also run the runtime side on MNN's ARM kernels there (llmexport/verification/arm.py;
    ``llmexport.mnn.arm.machine.arm_machine()``), at both precisions, into ``VerifyReport.arm``.
    """
    with mapped_blocks():
        return _verify_export(export_dir, model_path, steps, prompt_ids, raise_on_failure, trust_remote_code,
                              approximate_ignore_merges, text, lora, arm)


def _tokenizer_check(model_path: Path, tok_cases: dict[str, tuple[list[int], list[int]]],
                     approximate_ignore_merges: bool) -> TokenizerCheck:
    mismatches = tuple(t for t, (m, h) in tok_cases.items() if m != h)
    if not approximate_ignore_merges:
        return TokenizerCheck(not mismatches, len(tok_cases), mismatches)
    from tokenizers import Tokenizer

    from llmexport.mnn.tokenizer.writer import convert_tokenizer

    difference = convert_tokenizer(model_path, approximate_ignore_merges=True).ignore_merges_difference
    tj = json.loads((model_path / "tokenizer.json").read_text(encoding="utf-8"))
    tj["model"]["ignore_merges"] = False
    merges_only = Tokenizer.from_str(json.dumps(tj))
    approximated = tuple(t for t in mismatches
                         if tok_cases[t][0] == merges_only.encode(t, add_special_tokens=False).ids)
    left = tuple(t for t in mismatches if t not in approximated)
    return TokenizerCheck(not left, len(tok_cases), left, difference.to_json() if difference else {}, approximated)


def _verify_export(export_dir: Path, model_path: Path, steps: int, prompt_ids: list[int] | None,
                   raise_on_failure: bool, trust_remote_code: bool, approximate_ignore_merges: bool,
                   text: VerifyText | None, lora: Path | None, arm: Machine | None) -> VerifyReport:
    from transformers import AutoTokenizer

    arch = open_architecture(Checkpoint.open(model_path), lora)
    if arch.reference_is_remote_code and not trust_remote_code:
        raise UsageError(f"{model_path}: verifying a {arch.describe().family} export runs the checkpoint's "
                         "own modeling code; allow it with --trust_remote_code (trust_remote_code=True)")
    # Tokenizers are plain tokenizer.json files: never run a checkpoint's remote code for them.
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=False)
    window = int(arch.llm_config().get("sliding_window") or 0)
    prompt = prompt_ids or default_prompt(tokenizer, window + 8)
    stored = stored_tensors(export_dir, arch)
    profile = profile_of(json.loads((export_dir / "config.json").read_text()))
    # pre-quantized (MLX, GPTQ, AWQ) checkpoints: which weights kept their integers
    prequantized = compare_with_source(arch, arch.checkpoint.weights, stored)
    bounds = bounds_for_export(stored_bits(stored, prequantized), profile)
    # MNN's exact kernels hold every linear in fp32 (E4B: 20 GB): run only where that fits
    sizes = {n: stored.records[n].fields["oc"] * stored.records[n].fields["ic"] for n in stored.text_linears()}
    exact_refused = exact_kernels_refusal(sum(sizes.values()), (export_dir / LLM_WEIGHT).stat().st_size,
                                          int(arch.embedding_table().shape[0]),
                                          0 if stored.table_tensors() else sizes.get("lm_head", 0))
    skipped = []
    if exact_refused is not None:
        log.warning("verify: MNN's exact kernels skipped: %s", exact_refused)
        if bounds.kernels_max_abs_err is not None:
            skipped.append(f"exact-kernels runs: {exact_refused}")
            bounds = dataclasses.replace(bounds, kernels_max_abs_err=None)
        if arch.towers():
            skipped.append(f"media prompts and media conversations (run on the exact kernels): {exact_refused}")
    # the runtime first (its answers are the history, its greedy ids the teacher-forced ones); HF follows
    chat = Conversations.run(export_dir, tokenizer, window, bounds.kernels_max_abs_err is not None)
    texts = TOKENIZER_SAMPLES + [cast(str, tokenizer.decode(prompt[1:]))]  # one sequence: one string
    # the greedy ids everything is teacher-forced on: the exact kernels' where a fast export also
    # runs them (closer to HF, so HF's greedy ids are known further), else the shipped run's
    kernels = None
    if bounds.kernels_max_abs_err is not None:
        kernels = run_runtime(export_dir, prompt, None, steps, texts=texts, config=EXACT_KERNELS)
        run = run_runtime(export_dir, prompt, kernels.greedy_ids[:-1], steps, texts=texts)
    else:
        run = run_runtime(export_dir, prompt, None, steps, texts=texts)
    anchor = (kernels or run).greedy_ids
    # MNN's ARM kernels: the same ids and conversations, before HF loads (the runtime side first)
    arm_runs = None if arm is None else run_on_arm(arm, export_dir, prompt, anchor[:-1], steps,
                                                   script(tokenizer, window), window)
    forced = torch.tensor(prompt + anchor[:-1])
    oracle, fp32 = reference_pair(arch, stored, trust_remote_code)
    ref_logits = arch.reference_logits(oracle, forced, len(prompt) - 1).numpy()
    fp32_logits = arch.reference_logits(fp32, forced, len(prompt) - 1).numpy()
    greedy_ref = greedy_along(ref_logits, anchor, ())
    stop_ids = reference_stop_ids(model_path, tokenizer, arch)
    chat.add_oracle(arch, oracle, stop_ids)
    chat.add_fp32(arch, fp32)
    towers = verify_towers(arch, export_dir, oracle, fp32, media=exact_refused is None,
                           media_max_abs=bounds.exact_kernels_max_abs_err)
    tok_cases = {t: (run.encoded[t], tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts}
    tokenizer_check = _tokenizer_check(model_path, tok_cases, approximate_ignore_merges)
    shipped = RunComparison.of(compare_logits(run.forced_logits, ref_logits), greedy_ref, run.greedy_ids)
    exact = None
    if kernels is not None:
        exact = RunComparison.of(compare_logits(kernels.forced_logits, ref_logits), greedy_ref, kernels.greedy_ids)
    stream = StreamModel.from_folder(model_path)
    conversation = chat.check(tokenizer, stream)
    failures = judge(bounds, shipped, tokenizer_check, exact, towers) + tuple(conversation_failures(
        conversation, bounds.max_abs_err, bounds.mean_abs_err, bounds.kernels_max_abs_err))
    arm_report = None
    if arm_runs is not None:
        arm_report = arm_check(arm_runs, run, ref_logits, fp32_logits, greedy_ref, bounds, arch, oracle, fp32,
                               stop_ids, tokenizer, stream)
        failures += arm_failures(arm_report)
    text_quality = None if text is None else (str(text.path), score_text(export_dir, arch, tokenizer, fp32, text))
    report = VerifyReport(len(prompt), steps, tokenizer_check, profile, shipped,
                          compare_logits(run.forced_logits, fp32_logits), bounds, failures, towers, prequantized,
                          exact, conversation, tuple(skipped),
                          compare(fp32_logits, run.forced_logits, np.array(anchor[:len(fp32_logits)])), text_quality,
                          arm_report)
    (export_dir / "verify.json").write_text(json.dumps(report.to_json(), indent=2))
    log.info("verify: %s", summary_line(report))
    if raise_on_failure and not report.passed:
        raise VerificationFailed(f"{export_dir}: verification failed: {'; '.join(report.failures)}")
    return report


def score_text(export_dir: Path, arch: Architecture, tokenizer: Any, fp32: nn.Module, text: VerifyText) -> QualityStats:
    """The runtime against HF fp32 on windows of ``text`` (each window in a fresh runtime instance,
    one window's logits in memory at a time): perplexity, KLD and top-1 as llama.cpp defines them."""
    ids: list[int] = []
    for part in read_texts(text.path, "--verify_text"):
        ids.extend(tokenizer(part, add_special_tokens=False)["input_ids"])
    wins = windows(ids, text.length, text.windows, tokenizer.bos_token_id)
    if not wins:
        raise InputError(f"--verify_text {text.path}: {len(ids)} tokens; a window needs {text.length}")

    def parts() -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        for window, mnn in zip(wins, score_windows(export_dir, wins)):
            ref = arch.reference_logits(fp32, torch.tensor(window), 0).numpy()[:-1]
            yield ref, mnn, np.array(window[1:])

    stats = compare_parts(parts())
    log.info("verify: --verify_text %s: %s", text.path, stats.summary())
    return stats


def stored_tensors(export_dir: Path, arch: Architecture) -> StoredTensors:
    """What the export stored (text graph and towers), over the checkpoint's own tensors."""
    return StoredTensors(export_dir, arch, CheckpointTensors(arch.checkpoint.weights), arch.towers())


def reference_pair(arch: Architecture, stored: StoredTensors,
                   trust_remote_code: bool = False) -> tuple[nn.Module, nn.Module]:
    """The streamed HF references: carrying the weights the export stored (the fair oracle), and
    the checkpoint's own (fp32). Only their small parameters stay in memory between calls."""
    return (streamed_reference(arch, stored, trust_remote_code),
            streamed_reference(arch, stored.base, trust_remote_code))


def stored_bits(stored: StoredTensors, prequantized: dict[str, Any] | None) -> set[int]:
    """The bits of the text graph's linear records; counts the fp32-alpha records of a pre-quantized
    checkpoint into its ``prequantized`` section (transcoded records keep fp32 alpha, docs/mlx-import.md)."""
    records = [stored.records[name].fields["quanParameter"] for name in stored.text_linears()]
    if prequantized is not None:
        prequantized["fp32_alpha_records"] = sum(q.get("type") == 1 and q.get("scaleStorage", "FP32") != "FP16"
                                                 for q in records)
    return {int(q.get("aMaxOrBits", 16)) if q.get("type") == 1 else 16 for q in records}


def judge(bounds: Bounds, oracle: LogitStats, tokenizer: TokenizerCheck, exact_kernels: LogitStats | None = None,
          towers: Mapping[str, TowerReport] | None = None) -> tuple[str, ...]:
    """The failures of a verification. A run passes when every teacher-forced step agrees on top-1
    (unless its two logits' movements explain the flip: llmexport/verification/logits.py)
    and errors stay in bounds; judged for the shipped run and (fast profile) the exact-kernels run."""
    failures = run_failures("", oracle, bounds.max_abs_err, bounds.mean_abs_err)
    if exact_kernels is not None:
        if bounds.kernels_max_abs_err is None:
            raise ValueError(f"an exact-kernels run needs a kernels_max_abs_err bound ({bounds})")
        failures += run_failures("exact kernels: ", exact_kernels, bounds.kernels_max_abs_err, None)
    if not tokenizer.agree:
        failures.append(f"tokenizer disagrees on {len(tokenizer.mismatches)} sample(s)")
    for name, tower in (towers or {}).items():
        failures += [f"{name}: {failure}" for failure in tower.failures]
    return tuple(failures)


def summary_line(report: VerifyReport) -> str:
    o, f, b, kernels = report.oracle, report.fp32, report.bounds, report.exact_kernels
    exact = (f"; exact kernels: top-1 {kernels.top1_agreement:.0%}, max |dlogit| {kernels.max_abs_err:.2e} "
             f"(bound {b.kernels_max_abs_err})" if kernels else "")
    return (f"{'PASS' if report.passed else 'FAIL'} ({b.profile} profile): vs stored-weights HF: "
            f"top-1 {o.top1_agreement:.0%}, greedy {'match' if o.greedy_match else 'differs'}, "
            f"max |dlogit| {o.max_abs_err:.2e} (bound {b.max_abs_err}){exact}; vs fp32 HF: "
            f"top-1 {f.top1_agreement:.0%}, "
            + (f"KLD {report.fp32_quality.kld_mean:.2e}, " if report.fp32_quality else "")
            + f"max |dlogit| {f.max_abs_err:.2e}; "
            f"tokenizer {'agrees' if report.tokenizer.agree else 'DISAGREES'}"
            + "".join(f"; {prompt_summary(name, tower)}{media_conversation_summary(name, tower)}"
                      for name, tower in report.towers.items())
            + (f"; {conversation_summary(report.conversation)}" if report.conversation else "")
            + (f"; on {report.text_quality[0]} vs fp32 HF: {report.text_quality[1].summary()}"
               if report.text_quality else "")
            + (f"; {arm_summary(report.arm)}" if report.arm else "")
            + "".join(f"; SKIPPED {skipped}" for skipped in report.skipped))
