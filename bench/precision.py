"""fp16 on ARM: MNN's ``precision: low`` against ``normal`` on its ARM kernels, per family.

    python bench/precision.py [--models trained tiny | NAME ...] [--steps 256] [--out DIR] [--json OUT]

On x86 ``precision: low`` equals ``normal`` bit for bit (no fp16 arithmetic); on ARM it runs in
fp16 (MNN reports ``fp16:1``). Each model is exported with the defaults (4-bit, the fast profile)
and run by MNN's ARM kernels (natively on an ARM host, else under qemu-aarch64-static:
llmexport/mnn/arm/), one child for both precisions:

- ``normal``: ``--steps`` greedy tokens after the prompt, with its logits at each step;
- ``low``: teacher-forced along ``normal``'s greedy tokens (so both see the same ids), and its own
  ``--steps`` greedy tokens.

Reported per model: the mean and max KLD(normal || low) over those positions and their top-1
agreement; the share of repeated 4-grams in each greedy continuation (``normal``, ``low`` and the
HF model in fp32, greedy on the same prompt): the repetition loops MNN's Gemma4 write-up reports
at fp16 show there first; and how many greedy tokens ``low`` shares with ``normal`` from the start.

Models: ``trained`` = the trained bench models (llmexport/tiny/trained.py: ``trained:gemma4-e2b``,
``trained:llama``, ``trained:qwen3_5``; prompt: the opening of a held-out chapter), ``tiny`` = one tiny random
checkpoint per registered family (llmexport/tiny/registry.py; prompt: a chat-templated user turn).
Random weights have flat logits and near-ties, so fp16's top-1 flips there say less than on the
trained ones.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TRAINED = ("gemma4-e2b", "llama", "qwen3_5")  # recipes, named "trained:<recipe>" here


def repeated_ngrams(ids: list[int], n: int = 4) -> float:
    """The share of ``n``-grams of ``ids`` that already occurred earlier in it."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def kld(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KLD(p || q) per row, in float64."""
    p = p_logits.astype(np.float64)
    q = q_logits.astype(np.float64)
    p = p - p.max(axis=1, keepdims=True)
    q = q - q.max(axis=1, keepdims=True)
    logp = p - np.log(np.exp(p).sum(axis=1, keepdims=True))
    logq = q - np.log(np.exp(q).sum(axis=1, keepdims=True))
    return (np.exp(logp) * (logp - logq)).sum(axis=1)


def common_start(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _checkpoint(name: str, work: Path) -> tuple[Path, str]:
    """(checkpoint folder, kind) for a trained recipe or a registered model type."""
    if name.startswith("trained:"):
        from llmexport.tiny.trained import trained_checkpoint

        return trained_checkpoint(name.split(":", 1)[1]), "trained"
    from llmexport.tiny.registry import TINY_BUILDERS

    if name not in TINY_BUILDERS:
        raise SystemExit(f"unknown model {name!r}: trained:<recipe> ({', '.join(TRAINED)}) or a model type "
                         f"({', '.join(sorted(TINY_BUILDERS))})")
    return TINY_BUILDERS[name](work / f"ckpt-{name}", 0), "tiny"


def _prompt(checkpoint: Path, kind: str) -> list[int]:
    if kind == "trained":
        from llmexport.tiny.trained import bos_id, encode

        text = (checkpoint / "heldout.txt").read_text(encoding="utf-8") if (checkpoint / "heldout.txt").exists() \
            else "It is a truth universally acknowledged, that a single man in possession of a good fortune"
        bos = bos_id(checkpoint)
        return ([bos] if bos is not None else []) + encode(checkpoint, text[:400])[:48]
    from transformers import AutoTokenizer

    from llmexport.verification.verify import default_prompt

    return default_prompt(AutoTokenizer.from_pretrained(checkpoint), 16)


def hf_greedy(checkpoint: Path, prompt: list[int], steps: int) -> list[int]:
    """The fp32 HF model's greedy continuation (full forwards: tiny models)."""
    import torch

    from llmexport.reference.streamed import mapped_blocks, streamed_reference
    from llmexport.source.checkpoint import Checkpoint, CheckpointTensors
    from llmexport.source.loading import open_architecture

    arch = open_architecture(Checkpoint.open(checkpoint))
    ids = list(prompt)
    with mapped_blocks(), torch.no_grad():
        model = streamed_reference(arch, CheckpointTensors(arch.checkpoint.weights), arch.reference_is_remote_code)
        for _ in range(steps):
            logits = arch.reference_logits(model, torch.tensor(ids), len(ids) - 1)
            ids.append(int(logits[-1].argmax()))
    return ids[len(prompt):]


def measure(name: str, work: Path, steps: int, machine) -> dict[str, Any]:
    import llmexport
    from llmexport.mnn.runtime import run_calls, runtime_call

    checkpoint, kind = _checkpoint(name, work)
    export = work / f"export-{name}"
    shutil.rmtree(export, ignore_errors=True)
    llmexport.export(checkpoint, export, llmexport.ExportOptions())
    prompt = _prompt(checkpoint, kind)
    normal_cfg = {"thread_num": 2, "precision": "normal"}
    low_cfg = {"thread_num": 2, "precision": "low"}
    log: list[str] = []
    (normal,) = run_calls([runtime_call(export, prompt, None, steps, config=normal_cfg)], machine, output=log)
    (low,) = run_calls([runtime_call(export, prompt, normal.greedy_ids[:-1], steps, config=low_cfg)], machine)
    n = min(len(normal.forced_logits), len(low.forced_logits))
    div = kld(normal.forced_logits[:n], low.forced_logits[:n])
    top1 = float(np.mean(normal.forced_logits[:n].argmax(1) == low.forced_logits[:n].argmax(1)))
    hf = hf_greedy(checkpoint, prompt, steps)
    kernels = next((line for line in log if "fp16" in line or "sdot" in line), "")
    return {"model": name, "kind": kind, "machine": machine.name, "kernels": kernels.strip(), "prompt": len(prompt),
            "positions": n, "kld_mean": float(div.mean()), "kld_max": float(div.max()), "top1": top1,
            "rep4_normal": repeated_ngrams(normal.greedy_ids), "rep4_low": repeated_ngrams(low.greedy_ids),
            "rep4_hf": repeated_ngrams(hf), "low_shares_normal_greedy": common_start(low.greedy_ids, normal.greedy_ids),
            "normal_shares_hf_greedy": common_start(normal.greedy_ids, hf), "steps": steps}


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | KLD(normal‖low) mean / max | top-1 low vs normal | repeated 4-grams: HF / normal / low "
             "| greedy tokens shared: low with normal, normal with HF |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | error: {r['error'][:120]} | | | |")
            continue
        lines.append(f"| {r['model']} ({r['kind']}) | {r['kld_mean']:.2e} / {r['kld_max']:.2e} | {r['top1']:.1%} | "
                     f"{r['rep4_hf']:.2f} / {r['rep4_normal']:.2f} / {r['rep4_low']:.2f} | "
                     f"{r['low_shares_normal_greedy']}/{r['steps']}, {r['normal_shares_hf_greedy']}/{r['steps']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["trained", "tiny"],
                        help="'trained', 'tiny' (every registered family) or names of either")
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None, help="work folder (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from llmexport.mnn.arm.machine import arm_machine
    from llmexport.tiny.registry import TINY_BUILDERS

    names: list[str] = []
    for item in args.models:
        if item in ("trained", "tiny"):
            names += [f"trained:{r}" for r in TRAINED] if item == "trained" else sorted(TINY_BUILDERS)
        else:
            names.append(item)
    machine = arm_machine()
    work = args.out or Path(tempfile.mkdtemp(prefix="llmexport-bench-precision-"))
    rows = []
    for name in names:
        try:
            rows.append(measure(name, work, args.steps, machine))
        except Exception as exc:  # one model's failure is a row, not the end of the table
            rows.append({"model": name, "error": f"{type(exc).__name__}: {exc}"})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
    print(markdown(rows))
    if args.out is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
