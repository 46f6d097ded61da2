"""--verify's conversation check on a real-size export, with the HF models mapped from fp32 files.

    python bench/conversation.py EXPORT CHECKPOINT [--work DIR]

``verify_export`` builds its oracle in memory (about 8 bytes per parameter), which a real-size
E2B-shaped model does not fit beside the runtime on this 24 GB machine. This script runs the same
conversation (llmexport.verification_conversation: three turns, ``reset()``, two turns, one past
the sliding window, in one runtime instance) and judges it the same way, but takes the
stored-weights oracle and the fp32 model from fp32 safetensors folders
(llmexport.stored_checkpoint), which transformers maps from the file: table rows no prompt looks up
are never read. Prints one line per turn and the failures (none: PASS); exits 4 on a failure.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from llmexport.checkpoint import Checkpoint
    from llmexport.loading import open_architecture
    from llmexport.mnn.config import profile_of
    from llmexport.mnn.tokenizer_stream import StreamModel
    from llmexport.stored_checkpoint import write_stored_checkpoint
    from llmexport.verification import bounds_for_export, stored_bits
    from llmexport.verification_conversation import (
        Conversations,
        conversation_failures,
        conversation_summary,
        reference_stop_ids,
    )

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--work", type=Path, default=None, help="where the fp32 folders go (default: a temp dir)")
    args = parser.parse_args(argv)
    arch = open_architecture(Checkpoint.open(args.checkpoint))
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    window = int(arch.llm_config().get("sliding_window") or 0)
    profile = profile_of(json.loads((args.export / "config.json").read_text()))
    bounds = bounds_for_export(stored_bits(args.export, None), profile)
    start = time.perf_counter()
    chat = Conversations.run(args.export, tokenizer, window, bounds.kernels_max_abs_err is not None)
    print(f"runtime: {time.perf_counter() - start:.1f} s ({profile.value} profile"
          f"{', and on exact kernels' if chat.kernels is not None else ''})", flush=True)
    work = Path(tempfile.mkdtemp(prefix="llmexport-conv-", dir=args.work))
    try:
        for label, source in (("oracle", args.export), ("fp32", None)):
            start = time.perf_counter()
            folder = write_stored_checkpoint(source, arch, work / label)
            reference = open_architecture(Checkpoint.open(folder))
            model = reference.load_reference(None)
            if label == "oracle":
                chat.add_oracle(reference, model, reference_stop_ids(args.checkpoint, tokenizer, arch))
            else:
                chat.add_fp32(reference, model)
            del model, reference
            gc.collect()
            shutil.rmtree(folder)
            print(f"{label}: {time.perf_counter() - start:.1f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    check = chat.check(tokenizer, StreamModel.from_folder(args.checkpoint))
    for turn in check.turns:
        print(f"{turn.label}: prompt {turn.prompt_tokens} tokens (kept {turn.kept_tokens}, prefilled "
              f"{turn.prefilled_tokens}{', past the window' if turn.past_window else ''}), ids "
              f"{'= HF' if turn.prompt_ids_match else f'differ at {turn.prompt_mismatch_at}'}, greedy "
              f"{'= HF' if turn.oracle.greedy_match else 'differs'}, top-1 {turn.oracle.top1_agreement:.0%}, "
              f"max |dlogit| {turn.oracle.max_abs_err:.2e}"
              + (f", exact kernels {turn.exact_kernels.max_abs_err:.2e} (greedy "
                 f"{'= HF' if turn.exact_kernels.greedy_match else 'differs'})" if turn.exact_kernels else "")
              + f"; vs fp32 HF {turn.fp32.max_abs_err:.2e}; text {list(turn.text_difference) or 'equal'}")
    failures = conversation_failures(check, bounds.max_abs_err, bounds.mean_abs_err, bounds.kernels_max_abs_err)
    print(conversation_summary(check))
    print("PASS" if not failures else "FAIL:\n" + "\n".join(failures))
    return 0 if not failures else 4


if __name__ == "__main__":
    sys.exit(main())
