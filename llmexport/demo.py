"""``python -m llmexport.demo [OUT]`` (``make demo``): train, export, verify, and generate on both sides.

1. Trains a small Gemma4 with E2B's structure (per-layer embeddings, KV sharing, sliding and full
   layers) on the built-in text, chapters 1-6 of *Pride and Prejudice*
   (llmexport/tiny/data/), with llmexport's own deterministic trainer (llmexport/tiny/trained.py,
   recipe ``demo``): one to two minutes on one core, then cached. No download.
2. Exports it with the ``llmexport`` command, 4-bit, ``--verify`` (MNN's runtime against HF) with
   ``--verify_text`` on the same text (perplexity, KLD and top-1 against HF fp32).
3. Continues a sentence of the book greedily with HF in fp32 and with the MNN export in MNN's
   runtime, and prints both: a trained model makes the comparison mean something.

Exit status: the export's, or 1 when the two continuations differ.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from llmexport.tiny.corpus import corpus_from_file
from llmexport.tiny.trained import RECIPES, TrainRecipe, trained_checkpoint

BUILTIN_TEXT = Path(__file__).parent / "tiny" / "data" / "pride_and_prejudice_1-6.txt"
#: the opening of a paragraph of chapter 1; the model continues it
PROMPT = '"My dear Mr. Bennet," said his lady'
NEW_TOKENS = 24
#: --verify_text: perplexity, KLD and top-1 against HF fp32 on the text the model knows
EXPORT_FLAGS = ("--export", "mnn", "--quant_bit", "4", "--verify", "--verify_text", str(BUILTIN_TEXT))


def hf_continuation(checkpoint: Path, prompt_ids: list[int], steps: int) -> list[int]:
    """HF's greedy continuation in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False)
    return [int(i) for i in out[0, len(prompt_ids):]]


def mnn_continuation(export_dir: Path, prompt_ids: list[int], steps: int) -> list[int]:
    """The export's greedy continuation in MNN's runtime."""
    from llmexport.mnn.runtime import run_runtime

    return [int(i) for i in run_runtime(export_dir, prompt_ids, None, steps).greedy_ids[:steps]]


def export_command(checkpoint: Path, dst: Path) -> list[str]:
    return ["llmexport", "--path", str(checkpoint), "--dst_path", str(dst), *EXPORT_FLAGS]


def run_export(checkpoint: Path, dst: Path) -> int:
    """The ``llmexport`` command as a user types it (shown first), its output passed through."""
    command = export_command(checkpoint, dst)
    print(f"$ {shlex.join(command)}", flush=True)
    launcher = [sys.executable, "-c", "from llmexport.cli import main; main()"]
    return subprocess.run([*launcher, *command[1:]]).returncode


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def run_demo(out: Path, recipe: TrainRecipe = RECIPES["demo"]) -> int:
    from transformers import AutoTokenizer

    checkpoint = trained_checkpoint(recipe, corpus_from_file(BUILTIN_TEXT), log=print)
    report = json.loads((checkpoint / "training.json").read_text())
    print(f"trained model: {checkpoint} ({report['params']:,} parameters, {report['seconds']} s, "
          f"final training loss {report['last_loss']:.2f})", flush=True)
    dst = out / "mnn"
    code = run_export(checkpoint, dst)
    if code != 0:
        return code
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompt_ids = list(tokenizer(PROMPT).input_ids)
    hf = hf_continuation(checkpoint, prompt_ids, NEW_TOKENS)
    mnn = mnn_continuation(dst, prompt_ids, NEW_TOKENS)
    print(f"\nprompt:             {PROMPT}")
    print(f"HF (fp32):          {tokenizer.decode(hf)!r}")
    print(f"MNN export (4-bit): {tokenizer.decode(mnn)!r}")
    differs = first_difference(hf, mnn)
    if differs is None:
        print(f"the same {len(hf)} tokens from both")
        return 0
    print(f"the continuations differ from token {differs + 1} of {len(hf)}")
    return 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m llmexport.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", type=Path, default=Path("demo-out"), help="where the export goes")
    args = parser.parse_args(argv)
    sys.exit(run_demo(args.out))


if __name__ == "__main__":
    main()
