"""Long-prompt fidelity: MNN's runtime against the same-weights HF model at growing prompt lengths.

    python bench/long_context.py [CHECKPOINT] [--lengths 64 512 2048 8192] [--forced 8]
                                 [--hf-attention eager|sdpa] [--export DIR] [--json OUT]
                                 [--strided-linears]

The checkpoint (default: the 8-layer E2B-shaped random one, /work/ckpt/e2b-8) is exported at 16
bits. For each length, one prompt of random ordinary token ids is run by MNN's runtime (fresh
instance, the export's config.json settings) and ``--forced`` more tokens are teacher-forced;
the logits after the prompt and after each forced token are compared with

- HF: the family's HF model in fp32 carrying the weights read back from the export (as
  ``--verify`` does), one pass over the same ids;
- exact: the export's own graph (the traced rewrite, run eagerly) in fp64 with the same weights
  and constants, HF's fp32 up-casts kept in fp64, the RoPE angles as the model defines them
  (fp32, see ``fp64_upcasts``): the value both fp32 implementations round.

So each row says how far MNN is from HF, and how far each of them is from the exact result. The
three phases run one after the other (MNN in child processes, then fp64, then HF fp32), one length
at a time, so the process holds one model at a time (HF fp32 of the 8-layer E2B shape: ~5 GB).

Not a timed test: the machine only changes the run time.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

DEFAULT_CHECKPOINT = Path("/work/ckpt/e2b-8")
FIRST_ORDINARY_ID = 64  # the tiny/bench tokenizers keep their special tokens below this id
QUERY_CHUNK = 1024  # fp64 attention is computed this many queries at a time


def export_16bit(checkpoint: Path, out: Path) -> float:
    from llmexport import ExportOptions, export
    from llmexport.mnn.config import RuntimeProfile
    from llmexport.quant.scheme import QuantScheme

    start = time.perf_counter()
    # fp16 records run the same kernels under either runtime profile; exact says so in config.json
    export(checkpoint, out, ExportOptions(quant=QuantScheme(bits=16), runtime_profile=RuntimeProfile.EXACT, quiet=True))
    return time.perf_counter() - start


def random_ids(vocab: int, length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_ORDINARY_ID, vocab, (length,), generator=generator).tolist()


def stored_linears(export_dir: Path):
    """(name, fp32 weight, bias) of every linear record of llm.mnn, one at a time."""
    from llmexport.mnn.readback import linear_records
    from llmexport.mnn.weight_reader import read_linear

    for name, rec in linear_records(export_dir).items():
        weight, bias = read_linear(export_dir / "llm.mnn.weight", rec["external"], rec["quanParameter"],
                                   rec["oc"], rec["ic"])
        yield name, weight, bias


def _is_checkpoint_table(path: Path, table) -> bool:
    """Whether a 16-bit table file holds exactly the checkpoint's values (bf16 sources)."""
    stored, offset = np.memmap(path, dtype="<u2", mode="r"), 0
    for chunk in table.row_chunks():
        as_bf16 = chunk.to(torch.bfloat16)
        if not torch.equal(as_bf16.float(), chunk.float()):
            return False
        raw = as_bf16.contiguous().view(torch.int16).numpy().view("<u2").reshape(-1)
        if not np.array_equal(stored[offset:offset + raw.size], raw):
            return False
        offset += raw.size
    return offset == stored.size


def stored_tables(export_dir: Path, arch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(embedding, PLE) rows of the token table as stored, where they differ from the checkpoint's
    (a 16-bit table file is raw bf16: a bf16 checkpoint's tables are stored unchanged, and
    (None, None) is returned). A tied model without PLE has no token table: the runtime reads
    the lm_head record."""
    from llmexport.mnn.embeddings import read_embedding_table
    from llmexport.mnn.token_table import split_rows, token_table

    table = token_table(arch)
    if table is None:
        return None, None
    llm_config = json.loads((export_dir / "llm_config.json").read_text())
    if "tie_embeddings" in llm_config:
        raise SystemExit("the references read 16-bit tables: export with --embed_bit 16")
    path = export_dir / json.loads((export_dir / "config.json").read_text())["embedding_file"]
    if _is_checkpoint_table(path, table):
        return None, None
    return split_rows(arch, read_embedding_table(path, *table.shape, 16, 0))


# --- MNN ---------------------------------------------------------------------------------------
def mnn_logits(export_dir: Path, ids: list[int], n: int, threads: int) -> np.ndarray:
    from llmexport.mnn.runtime import run_runtime

    prompt, forced = ids[:len(ids) - n + 1], ids[len(ids) - n + 1:]
    return run_runtime(export_dir, prompt, forced, 0, config={"thread_num": threads}, timeout=7200).forced_logits


# --- exact (fp64) ------------------------------------------------------------------------------
@contextmanager
def fp64_upcasts():
    """The rewrite (like HF) up-casts norms, softmax and routing to fp32 with ``.float()``; in an
    fp64 run those keep fp64. The RoPE angles stay what the model defines, fp32 products of
    position and fp32 inverse frequency (HF computes them in fp32, and so does the graph: both
    runtimes get the same angles), and their cos/sin are taken in fp64. Attention is computed
    QUERY_CHUNK queries at a time (same math)."""
    import llmexport.trace.ops as ops

    to_float, reference = torch.Tensor.float, ops.attention_reference
    cos, sin = torch.Tensor.cos, torch.Tensor.sin

    def chunked(q, k, v, mask, scale):
        parts = [reference(q[:, i:i + QUERY_CHUNK], k, v, mask[..., i:i + QUERY_CHUNK, :], scale)
                 for i in range(0, q.shape[1], QUERY_CHUNK)]
        return torch.cat(parts, dim=1)

    torch.Tensor.float = lambda self, *a, **k: self if self.dtype == torch.float64 else to_float(self, *a, **k)
    torch.Tensor.cos = lambda self: cos(self.double())
    torch.Tensor.sin = lambda self: sin(self.double())
    ops.attention_reference = chunked
    try:
        yield
    finally:
        torch.Tensor.float, ops.attention_reference = to_float, reference
        torch.Tensor.cos, torch.Tensor.sin = cos, sin


def as_fp64(graph: torch.nn.Module) -> torch.nn.Module:
    """The rewrite in fp64, but for the RoPE inverse frequencies: they stay the traced fp32
    constants, so that the angles are the model's fp32 ones (``fp64_upcasts``)."""
    graph = graph.double()
    for module in graph.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if "inv_freq" in name:
                setattr(module, name, buffer.to(torch.float32))  # not .float(): patched in fp64_upcasts
    return graph


class _ChunkedHead(torch.nn.Module):
    """lm_head in fp64 from the fp32 stored weight, vocabulary rows a block at a time."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = 1 << 15
        return torch.cat([hidden @ self.weight[i:i + rows].double().T for i in range(0, len(self.weight), rows)], -1)


def exact_graph(arch, export_dir: Path, tables):
    """The family's rewrite in fp64 with the export's stored weights: (graph, embedding, PLE)."""
    from llmexport.trace.eager import placeholders

    graph = arch.build_graph()
    by_name = {linear.name: linear for linear in placeholders(graph)}
    head = None
    for name, weight, bias in stored_linears(export_dir):
        if name == "lm_head":
            head = weight
            continue
        by_name[name].bind(weight.double(), None if bias is None else bias.double())
    graph = as_fp64(graph)
    graph.lm_head = _ChunkedHead(head)
    # without a token table (mnn/token_table.py) the runtime reads a tied embedding out of the lm_head record
    from llmexport.mnn.token_table import token_table

    embedding, ple = tables
    embedding = head if token_table(arch) is None else (embedding if embedding is not None else arch.embedding_table())
    return graph, embedding, ple if ple is not None else arch.ple_table()


def exact_logits(arch, graph, embedding, ple, ids: list[int], n: int) -> np.ndarray:
    from llmexport.trace.eager import prompt_inputs

    args = list(prompt_inputs(arch, torch.tensor(ids), embedding, ple, all_logits=False))
    args[3] = torch.tensor([len(ids) - n], dtype=torch.int32)  # logits of the last n positions
    args = [a.double() if a.is_floating_point() else a for a in args]
    with torch.no_grad(), fp64_upcasts():
        return graph(*args)[0][0].numpy()


# --- HF fp32 -----------------------------------------------------------------------------------
class _LastPositions(torch.nn.Module):
    """lm_head on the last ``n`` positions only (8192 x 262144 fp32 logits would be 8.6 GB)."""

    def __init__(self, head: torch.nn.Module, n: int):
        super().__init__()
        self.head, self.n = head, n

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden[..., -self.n:, :])


def load_hf(arch, export_dir: Path):
    """HF's model in fp32 carrying the stored weights, streamed (llmexport.reference.streamed: one
    layer's weights in memory at a time)."""
    from llmexport.mnn.readback import StoredTensors
    from llmexport.reference.streamed import streamed_reference
    from llmexport.source.checkpoint import CheckpointTensors

    return streamed_reference(arch, StoredTensors(export_dir, arch, CheckpointTensors(arch.checkpoint.weights)))


def hf_logits(arch, model, ids: list[int], n: int) -> np.ndarray:
    head = model.lm_head
    model.lm_head = _LastPositions(head, n)
    try:
        return arch.reference_logits(model, torch.tensor(ids))[-n:].numpy()
    finally:
        model.lm_head = head


# --- report ------------------------------------------------------------------------------------
def compare(a: np.ndarray, b: np.ndarray) -> dict:
    err = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return {"max": float(err.max()), "mean": float(err.mean()),
            "top1": float(np.mean(a.argmax(-1) == b.argmax(-1)))}


def measure(checkpoint: Path, export_dir: Path, lengths: list[int], forced: int, attentions: list[str],
            eager_max: int) -> dict:
    from llmexport.source.checkpoint import Checkpoint
    from llmexport.source.loading import open_architecture

    arch = open_architecture(Checkpoint.open(checkpoint))
    tables = stored_tables(export_dir, arch)
    runtime = json.loads((export_dir / "config.json").read_text())
    n = forced + 1
    prompts = {length: random_ids(arch.args.vocab_size, length + forced, seed=length) for length in lengths}
    logits: dict[str, dict[int, np.ndarray]] = {}
    seconds: dict[str, dict[int, float]] = {}

    def timed(kind, length, fn):
        start = time.perf_counter()
        logits.setdefault(kind, {})[length] = fn()
        seconds.setdefault(kind, {})[length] = round(time.perf_counter() - start, 1)
        gc.collect()

    for length, ids in prompts.items():
        timed("mnn", length, lambda: mnn_logits(export_dir, ids, n, int(runtime.get("thread_num") or 2)))
    graph, embedding, ple = exact_graph(arch, export_dir, tables)
    for length, ids in prompts.items():
        timed("exact", length, lambda g=graph, e=embedding, p=ple: exact_logits(arch, g, e, p, ids, n))
    del graph, embedding, ple
    gc.collect()
    model = load_hf(arch, export_dir)
    for attention in attentions:
        model.set_attn_implementation(attention)
        for length, ids in prompts.items():
            if attention != "eager" or length <= eager_max:
                timed(attention, length, lambda: hf_logits(arch, model, ids, n))
    rows = []
    for length in lengths:
        for attention in (a for a in attentions if length in logits.get(a, {})):
            hf = logits[attention][length]
            rows.append({"prompt_tokens": length, "hf_attention": attention,
                         "mnn_vs_hf": compare(logits["mnn"][length], hf),
                         "mnn_vs_exact": compare(logits["mnn"][length], logits["exact"][length]),
                         "hf_vs_exact": compare(hf, logits["exact"][length]),
                         "logit_absmax": float(np.abs(logits["exact"][length]).max()),
                         "seconds": {"mnn": seconds["mnn"][length], "exact": seconds["exact"][length],
                                     "hf": seconds[attention][length]}})
    settings = {k: runtime.get(k) for k in ("backend_type", "precision", "memory", "thread_num", "attention_mode")}
    return {"checkpoint": str(checkpoint), "settings": settings, "forced": forced, "rows": rows}


def table(result: dict) -> str:
    lines = ["| prompt tokens | HF attention | MNN vs HF fp32: max abs dlogit | top-1 agreement | MNN vs exact | "
             "HF fp32 vs exact | logit abs max | MNN s | HF s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        lines.append(f"| {r['prompt_tokens']} | {r['hf_attention']} | {r['mnn_vs_hf']['max']:.3g} | "
                     f"{r['mnn_vs_hf']['top1']:.2f} | {r['mnn_vs_exact']['max']:.3g} | {r['hf_vs_exact']['max']:.3g} | "
                     f"{r['logit_absmax']:.2f} | {r['seconds']['mnn']} | {r['seconds']['hf']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", nargs="?", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 512, 2048, 8192])
    parser.add_argument("--forced", type=int, default=8, help="teacher-forced tokens after each prompt")
    parser.add_argument("--hf-attention", choices=["eager", "sdpa"], nargs="+", default=["eager", "sdpa"],
                        help="HF attention implementations to compare with (sdpa agrees with eager at fp32 noise)")
    parser.add_argument("--eager-max", type=int, default=4096,
                        help="longest prompt for eager attention (8192 tokens: ~2 GB per score matrix)")
    parser.add_argument("--export", type=Path, help="reuse (or keep) the 16-bit export in this folder")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--strided-linears", action="store_true",
                        help="run MNN on a copy whose linears have stride 2 (bench/kernel_choice.py: no Strassen)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="llmexport-long-") as tmp:
        export_dir = args.export or Path(tmp) / "export"
        export_s = 0.0 if (export_dir / "config.json").exists() else export_16bit(args.checkpoint, export_dir)
        if args.strided_linears:
            from kernel_choice import strided_copy

            export_dir = strided_copy(export_dir, Path(tmp) / "strided")
        result = measure(args.checkpoint, export_dir, args.lengths, args.forced, args.hf_attention, args.eager_max)
    print(f"checkpoint {args.checkpoint}, 16-bit export ({export_s:.0f} s); runtime settings {result['settings']}; "
          f"HF fp32 with the stored weights; {args.forced} forced tokens, "
          f"{args.forced + 1} positions compared per length")
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
