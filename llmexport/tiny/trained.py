"""Small models trained on real English text, deterministically, on the CPU, cached.

Random-weight models have flat logits, so they say little about the quality a quantization
keeps. These are trained for a few minutes on Jane Austen's novels (llmexport/tiny/corpus.py),
with a tokenizer learned on the same text, and then behave like language models: peaked
next-token distributions whose held-out perplexity is far below the vocabulary size.

    python -m llmexport.tiny.trained gemma4-e2b [--text FILE] [--cache DIR]

Each recipe is a frozen dataclass; a trained checkpoint lives in
``$LLMEXPORT_TRAINED_CACHE`` (default ``~/.cache/llmexport/trained``) under
``<name>-<hash of the recipe and the training text>``, with ``training.json`` (loss curve,
held-out perplexity, time). The same recipe on the same text and thread count gives the same
weights, bit for bit: fixed seeds, deterministic algorithms, batches drawn from a seeded generator.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from llmexport.tiny.corpus import Corpus, CorpusError, austen_corpus, corpus_from_file
from llmexport.verification.quality import perplexity, token_nll, windows

#: bumped when the training code changes what a recipe produces (part of the cache key)
TRAINER_VERSION = 1
CACHE_ENV = "LLMEXPORT_TRAINED_CACHE"

# family -> writes an untrained checkpoint (config with the recipe's overrides, tokenizer learned on
# the text: paragraphs separated by empty lines) to a folder:
# (out, vocab_size, config overrides, tokenizer text, seed) -> out
Writer = Callable[[Path, int, dict[str, Any], str, int], Path]


def _gemma4_writer(out: Path, vocab_size: int, overrides: dict[str, Any], text: str, seed: int) -> Path:
    from llmexport.tiny.gemma4 import build_gemma4_checkpoint, trained_text_config

    return build_gemma4_checkpoint(out, {**trained_text_config(vocab_size), **overrides}, seed=seed, text_only=True,
                                   tokenizer_corpus=text)


def _llama_writer(out: Path, vocab_size: int, overrides: dict[str, Any], text: str, seed: int) -> Path:
    from llmexport.tiny.decoders import build_decoder_checkpoint, trained_config

    family, config = trained_config(vocab_size)
    return build_decoder_checkpoint(out, family, {**config, **overrides}, seed=seed, dtype=torch.float32,
                                    tokenizer_corpus=text)


def _qwen3_5_writer(out: Path, vocab_size: int, overrides: dict[str, Any], text: str, seed: int) -> Path:
    from llmexport.tiny.qwen3_5 import build_qwen3_5_checkpoint, trained_config

    model_type, config = trained_config(vocab_size)
    return build_qwen3_5_checkpoint(out, model_type, {**config, **overrides}, seed=seed, dtype=torch.float32,
                                    tokenizer_corpus=text)


WRITERS: dict[str, Writer] = {"gemma4": _gemma4_writer, "llama": _llama_writer, "qwen3_5": _qwen3_5_writer}


@dataclass(frozen=True)
class TrainRecipe:
    """How one model is trained. ``threads`` is part of it: CPU kernels split reductions by thread
    (and one thread is the fastest on a small shared machine: at these sizes two threads spent
    10-50x longer per step waiting on each other when another process used the second core)."""

    name: str
    family: str  # a key of WRITERS
    vocab_size: int = 2048
    seq_len: int = 128
    batch_size: int = 8
    steps: int = 240
    lr: float = 3e-3
    warmup: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    threads: int = 1
    eval_windows: int = 16
    #: changes to the family's trained shape (llmexport/tiny/gemma4.py trained_text_config,
    #: llmexport/tiny/decoders.py trained_config), as (key, value) pairs
    config: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.family not in WRITERS:
            raise ValueError(f"recipe {self.name}: unknown family {self.family!r}; choose from {sorted(WRITERS)}")
        if self.steps < 1 or self.batch_size < 1 or self.seq_len < 2:
            raise ValueError(f"recipe {self.name}: steps, batch_size must be >= 1 and seq_len >= 2")


RECIPES: dict[str, TrainRecipe] = {
    "gemma4-e2b": TrainRecipe("gemma4-e2b", "gemma4"),
    "llama": TrainRecipe("llama", "llama"),
    # make demo's model (llmexport/demo.py): E2B's structure at a quarter of the width, trained on
    # the built-in 42 KB text until it knows most of it by heart (training loss 0.29), in one to two
    # minutes on one thread
    "demo": TrainRecipe("demo", "gemma4", vocab_size=1024, seq_len=64, batch_size=16, steps=600, lr=4e-3,
                        config=(("hidden_size", 128), ("intermediate_size", 256), ("num_attention_heads", 2),
                                ("head_dim", 32), ("global_head_dim", 64), ("hidden_size_per_layer_input", 16),
                                ("sliding_window", 32),
                                ("layer_types", ("sliding_attention", "sliding_attention", "sliding_attention",
                                                 "full_attention", "sliding_attention", "full_attention")),
                                ("num_hidden_layers", 6), ("num_kv_shared_layers", 2))),
    # a Qwen3.5 text model (Gated DeltaNet + gated attention) trained on the built-in text: the
    # recurrence's sensitivity judged on trained weights rather than random ones
    "qwen3_5": TrainRecipe("qwen3_5", "qwen3_5", vocab_size=1024, seq_len=64, batch_size=16, steps=400, lr=4e-3),
}


@dataclass(frozen=True)
class TrainResult:
    path: Path
    params: int
    tokens_seen: int
    seconds: float
    losses: tuple[float, ...]  # training loss per step
    heldout_ppl: float
    heldout_positions: int

    def to_json(self) -> dict[str, Any]:
        return {"params": self.params, "tokens_seen": self.tokens_seen, "seconds": round(self.seconds, 1),
                "first_loss": self.losses[0], "last_loss": self.losses[-1], "losses": list(self.losses),
                "heldout_ppl": self.heldout_ppl, "heldout_positions": self.heldout_positions}


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "llmexport" / "trained")


def recipe_key(recipe: TrainRecipe, corpus: Corpus) -> str:
    """The cache key: the recipe, the texts (training; held out, which training.json scores), the
    trainer version and the versions of torch and transformers (kernels, initialisation)."""
    import transformers

    versions = {"trainer": TRAINER_VERSION, "torch": torch.__version__.split("+")[0],
                "transformers": transformers.__version__}
    digest = hashlib.sha256(json.dumps({"recipe": asdict(recipe), **versions}, sort_keys=True).encode())
    for text in (corpus.train, corpus.heldout):
        digest.update(hashlib.sha256(text.encode()).digest())
    return f"{recipe.name}-{digest.hexdigest()[:12]}"


def encode(checkpoint: Path, text: str) -> list[int]:
    """``text`` in the checkpoint's tokenizer, without special tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    return list(tok.encode(text, add_special_tokens=False).ids)


def bos_id(checkpoint: Path) -> int | None:
    value = json.loads((checkpoint / "config.json").read_text()).get("bos_token_id")
    return int(value) if isinstance(value, int) else None


def _lr(recipe: TrainRecipe, step: int) -> float:
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    progress = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    return recipe.lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _batch(ids: torch.Tensor, recipe: TrainRecipe, bos: int | None, generator: torch.Generator) -> torch.Tensor:
    body = recipe.seq_len - (bos is not None)
    if len(ids) <= body:
        raise CorpusError(f"the training text is {len(ids)} tokens, shorter than one window of {body}")
    starts = torch.randint(0, len(ids) - body, (recipe.batch_size,), generator=generator)
    rows = torch.stack([ids[s:s + body] for s in starts.tolist()])
    if bos is not None:
        rows = torch.cat([torch.full((recipe.batch_size, 1), bos, dtype=rows.dtype), rows], dim=1)
    return rows


def heldout_nll(model: torch.nn.Module, held: list[list[int]]) -> np.ndarray:
    """NLL of every scored position of the held-out windows (one forward per window)."""
    out = []
    with torch.no_grad():
        for window in held:
            logits = model(torch.tensor([window])).logits[0, :-1].float().numpy()
            out.append(token_nll(logits, np.array(window[1:])))
    return np.concatenate(out)


class _Deterministic:
    """Deterministic kernels and a fixed thread count for the duration of a training run."""

    def __init__(self, threads: int) -> None:
        self.threads = threads

    def __enter__(self) -> None:
        self.saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())
        torch.set_num_threads(self.threads)
        torch.use_deterministic_algorithms(True)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.saved[0])
        torch.use_deterministic_algorithms(self.saved[1])


def train(recipe: TrainRecipe, corpus: Corpus, out: Path, log: Callable[[str], None] | None = None) -> TrainResult:
    """Train ``recipe`` on ``corpus`` into the checkpoint folder ``out`` (written anew)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not corpus.train.strip() or not corpus.heldout.strip():
        raise CorpusError(f"{corpus.source}: the training or the held-out text is empty")
    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)
    # a recipe keeps sequences as tuples (it is frozen); configs take lists
    overrides = {key: list(value) if isinstance(value, tuple) else value for key, value in recipe.config}
    WRITERS[recipe.family](out, recipe.vocab_size, overrides, corpus.train.replace("\n", "\n\n"), recipe.seed)
    generation = (out / "generation_config.json").read_text()
    start = time.perf_counter()
    with _Deterministic(recipe.threads):
        torch.manual_seed(recipe.seed)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out), dtype=torch.float32)
        ids = torch.tensor(encode(out, corpus.train), dtype=torch.long)
        bos = bos_id(out)
        generator = torch.Generator().manual_seed(recipe.seed + 1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.95),
                                      weight_decay=recipe.weight_decay)
        losses: list[float] = []
        model.train()
        for step in range(recipe.steps):
            for group in optimizer.param_groups:
                group["lr"] = _lr(recipe, step)
            batch = _batch(ids, recipe, bos, generator)
            loss = model(input_ids=batch, labels=batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
            optimizer.step()
            losses.append(loss.item())
            if log and (step % 25 == 0 or step == recipe.steps - 1):
                log(f"{recipe.name}: step {step + 1}/{recipe.steps} loss {losses[-1]:.3f} "
                    f"({time.perf_counter() - start:.0f} s)")
        model.eval()
        held = windows(encode(out, corpus.heldout), recipe.seq_len, recipe.eval_windows, bos)
        nll = heldout_nll(model, held)
    seconds = time.perf_counter() - start
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(generation)
    result = TrainResult(out, sum(p.numel() for p in model.parameters()),
                         recipe.steps * recipe.batch_size * recipe.seq_len, seconds, tuple(losses),
                         perplexity(nll), int(nll.size))
    (out / "training.json").write_text(json.dumps({"recipe": asdict(recipe), "source": corpus.source,
                                                   **result.to_json()}, indent=1))
    return result


def default_corpus(text: Path | str | None = None) -> Corpus:
    """A text file's corpus, or Austen's novels (fetched into the cache once)."""
    return corpus_from_file(text) if text else austen_corpus(cache_root())


def trained_checkpoint(recipe: TrainRecipe | str, corpus: Corpus | None = None, *,
                       log: Callable[[str], None] | None = None) -> Path:
    """The checkpoint folder of ``recipe`` trained on ``corpus`` (default Austen), trained now
    unless the cache has it."""
    if isinstance(recipe, str):
        if recipe not in RECIPES:
            raise ValueError(f"unknown trained model {recipe!r}; choose from {sorted(RECIPES)}")
        recipe = RECIPES[recipe]
    corpus = corpus or default_corpus()
    folder = cache_root() / recipe_key(recipe, corpus)
    if (folder / "training.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    # one trainer per recipe at a time (parallel test workers, two demos): the others wait for its result
    with open(folder.with_name(folder.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "training.json").is_file():
            staging = folder.with_name(folder.name + ".part")
            train(recipe, corpus, staging, log)
            shutil.rmtree(folder, ignore_errors=True)
            staging.replace(folder)
    return folder


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m llmexport.tiny.trained", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=sorted(RECIPES))
    parser.add_argument("--text", type=Path, default=None, help="a UTF-8 text file instead of Austen's novels")
    parser.add_argument("--steps", type=int, default=None, help="override the recipe's step count")
    args = parser.parse_args(argv)
    recipe = RECIPES[args.name] if args.steps is None else replace(RECIPES[args.name], steps=args.steps)
    try:
        path = trained_checkpoint(recipe, default_corpus(args.text), log=print)
    except CorpusError as exc:
        raise SystemExit(f"error: {exc}") from None
    report = json.loads((path / "training.json").read_text())
    print(f"{path}: {report['params']} parameters, held-out perplexity {report['heldout_ppl']:.2f}, "
          f"trained in {report['seconds']} s")


if __name__ == "__main__":
    main()
