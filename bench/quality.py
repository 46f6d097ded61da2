"""What each quantization scheme costs in quality, on small models trained on real English text.

    python bench/quality.py [--models gemma4-e2b,llama] [--windows 16] [--quick] [--text FILE]
                            [--schemes fp16,q8,q4,q4-hqq,mlp4-attn8,q4-gptq,...] [--json OUT.json]

For each trained model (llmexport/tiny/trained.py: trained once, then cached) the held-out text
(Austen's *Persuasion*, or the last tenth of ``--text``) is cut into windows of the training
length, each starting with BOS. The HF model in fp32 scores every position of every window; then
the model is exported with llmexport under each scheme, and MNN's runtime scores the same
windows, each window in a fresh runtime instance (first token, then one token at a time), under
both runtime profiles. The exports are made once per scheme: ``--runtime_profile`` only writes
the memory mode into config.json (llmexport/mnn/config.py PROFILE_KEYS), which is given to the
runtime here instead. Reported per (model, scheme, profile), with llama.cpp's definitions
(llmexport/verification/quality.py): PPL of HF fp32 and of MNN, KLD(HF fp32 || MNN) mean and 99th percentile,
top-1 agreement, the weight files' size and bits per weight (8 x those bytes / the model's
parameter count). The ``-gptq``, ``-awq`` and ``-smooth`` schemes calibrate (``--calib_data``, with
``--calib_method``) on the training text (and ``bpw5.04-gptq`` measures its sensitivities there too).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmexport.mnn.config import LLM_WEIGHT, PROFILE_KEYS, RuntimeProfile  # noqa: E402
from llmexport.mnn.runtime import run_windows  # noqa: E402
from llmexport.tiny.corpus import CorpusError  # noqa: E402
from llmexport.tiny.trained import RECIPES, bos_id, default_corpus, encode, trained_checkpoint  # noqa: E402
from llmexport.verification.quality import QualityStats, compare, windows  # noqa: E402

#: GPTQ calibration on 32 windows of 128 tokens of the *training* text (CALIBRATION_TEXT is the
#: file's place in the flags; the held-out text that is scored is never calibrated on)
CALIBRATION_TEXT = "{calibration text}"
CALIBRATION = ["--calib_data", CALIBRATION_TEXT, "--calib_samples", "32", "--calib_seq_len", "128"]
SCHEMES: dict[str, list[str]] = {
    "fp16": ["--quant_bit", "16"],
    "q8": ["--quant_bit", "8"],
    "q4": ["--quant_bit", "4"],
    "q4-hqq": ["--quant_bit", "4", "--hqq"],
    "mlp4-attn8": ["--quant_config", "mlp4-attn8"],
    "q4-gptq": ["--quant_bit", "4", *CALIBRATION],
    "q4-hqq-gptq": ["--quant_bit", "4", "--hqq", *CALIBRATION],
    "q4-awq": ["--quant_bit", "4", *CALIBRATION, "--calib_method", "awq"],
    "q4-awq-gptq": ["--quant_bit", "4", *CALIBRATION, "--calib_method", "awq+gptq"],
    "q4-hqq-awq": ["--quant_bit", "4", "--hqq", *CALIBRATION, "--calib_method", "awq"],
    "q8-smooth": ["--quant_bit", "8", *CALIBRATION, "--calib_method", "smooth"],
    "q4-smooth": ["--quant_bit", "4", *CALIBRATION, "--calib_method", "smooth"],
    "q4-lm8": ["--quant_bit", "4", "--lm_quant_bit", "8"],
    "q4-gptq-lm8": ["--quant_bit", "4", "--lm_quant_bit", "8", *CALIBRATION],
    # a size budget 12% above uniform q4's 4.5 bits per weight (block 64: 4 bits + an fp16 scale and
    # zero per 64 weights), each linear's scheme chosen by measured KLD (llmexport/calibration/size_budget.py)
    "bpw5.04": ["--quant_bit", "4", "--target_bpw", "5.04"],
    "bpw5.04-gptq": ["--quant_bit", "4", "--target_bpw", "5.04", *CALIBRATION],
}
MIB = 2**20


def reference_logits(checkpoint: Path, wins: list[list[int]]) -> tuple[np.ndarray, int]:
    """HF fp32 logits of every scored position ``[positions, vocab]`` and the parameter count."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = [model(torch.tensor([w])).logits[0, :-1].float().numpy() for w in wins]
    return np.concatenate(logits), sum(p.numel() for p in model.parameters())


def export(checkpoint: Path, dst: Path, flags: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", "from llmexport.cli import main; main()", "--path", str(checkpoint),
                           "--dst_path", str(dst), "--quiet", *flags], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"export {' '.join(flags)} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return time.perf_counter() - start


def weight_bytes(dst: Path) -> int:
    """llm.mnn.weight and the token-table files (what the weights cost on disk)."""
    return (dst / LLM_WEIGHT).stat().st_size + sum(p.stat().st_size for p in dst.glob("embeddings_*.bin"))


def score_model(name: str, args: argparse.Namespace, corpus, work: Path) -> list[dict]:
    recipe = RECIPES[name]
    checkpoint = trained_checkpoint(recipe, corpus, log=lambda line: print(line, file=sys.stderr))
    training = json.loads((checkpoint / "training.json").read_text())
    wins = windows(encode(checkpoint, corpus.heldout), recipe.seq_len, args.windows, bos_id(checkpoint))
    targets = np.concatenate([np.array(w[1:]) for w in wins])
    ref, params = reference_logits(checkpoint, wins)
    rows = []
    calibration_text = work / "calibration.txt"
    calibration_text.write_text(corpus.train, encoding="utf-8")
    for scheme in args.schemes:
        dst = work / f"{name}-{scheme}"
        flags = [str(calibration_text) if flag == CALIBRATION_TEXT else flag for flag in SCHEMES[scheme]]
        seconds = export(checkpoint, dst, flags)
        size = weight_bytes(dst)
        for profile in RuntimeProfile:
            start = time.perf_counter()
            mnn = np.concatenate(run_windows(dst, wins, {"thread_num": 2, **PROFILE_KEYS[profile]}))
            stats: QualityStats = compare(ref, mnn, targets)
            rows.append({"model": name, "scheme": scheme, "profile": profile.value, **stats.to_json(),
                         "weight_mib": size / MIB, "bpw": 8 * size / params, "params": params,
                         "export_s": round(seconds, 1), "score_s": round(time.perf_counter() - start, 1),
                         "train_s": training["seconds"], "train_heldout_ppl": training["heldout_ppl"]})
            print(json.dumps(rows[-1]), file=sys.stderr)
        shutil.rmtree(dst, ignore_errors=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | scheme | profile | PPL HF fp32 | PPL MNN | dPPL | KLD mean | KLD p99 | top-1 | weights MiB | "
             "bits/weight |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['scheme']} | {r['profile']} | {r['ppl_ref']:.3f} | {r['ppl_test']:.3f} | "
                     f"{r['delta_ppl']:+.3f} | {r['kld_mean']:.2e} | {r['kld_p99']:.2e} | {100 * r['top1']:.2f}% | "
                     f"{r['weight_mib']:.2f} | {r['bpw']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(RECIPES))
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--windows", type=int, default=16, help="held-out windows per model (127 positions each)")
    parser.add_argument("--quick", action="store_true", help="4 windows, fp16 and q4 only")
    parser.add_argument("--text", type=Path, default=None, help="a UTF-8 text file instead of Austen's novels")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    args.schemes = args.schemes.split(",")
    if args.quick:
        args = replace_quick(args)
    unknown = sorted(set(args.schemes) - set(SCHEMES)) + sorted(set(args.models.split(",")) - set(RECIPES))
    if unknown:
        raise SystemExit(f"unknown scheme or model: {', '.join(unknown)}")
    try:
        corpus = default_corpus(args.text)
    except CorpusError as exc:
        raise SystemExit(f"error: {exc}") from None
    work = Path(tempfile.mkdtemp(prefix="llmexport-bench-quality-"))
    try:
        rows = [row for name in args.models.split(",") for row in score_model(name, args, corpus, work)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(table(rows))


def replace_quick(args: argparse.Namespace) -> argparse.Namespace:
    quick = argparse.Namespace(**vars(args))
    quick.windows = min(args.windows, 4)
    quick.schemes = [s for s in args.schemes if s in ("fp16", "q4")]
    return quick


if __name__ == "__main__":
    main()
