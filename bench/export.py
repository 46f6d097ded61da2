"""Export benchmark: wall time per stage against the I/O + kernel floor, peak RSS, size, runtime speed.

    python bench/export.py CHECKPOINT [--out DIR] [--quant_bit 4] [--embed_bit 4] [--no-runtime]

Everything is measured in this one run, side by side:
- the export, run as ``llmexport`` in a child process; its peak RSS (the largest of it and the
  converter processes it starts) and the wall time of each stage it reports;
- the floor: reading every byte of the checkpoint once, plus the bare quantization kernels on
  the same tensors (what no exporter can avoid), and the ratio wall / floor;
- the export size; ``llmexport --help`` start-up time;
- MNN's runtime on the export: load time, prefill and decode tokens/s (2 threads).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _read_floor(checkpoint: Path) -> tuple[float, int]:
    start, total = time.perf_counter(), 0
    buf = bytearray(64 << 20)
    for file in sorted(checkpoint.glob("*.safetensors")):
        with open(file, "rb", buffering=0) as f:
            while (n := f.readinto(buf)) > 0:
                total += n
    return time.perf_counter() - start, total


def _kernel_floor(checkpoint: Path, bits: int, block: int, embed_bit: int) -> float:
    """Bare quantization time of every linear and table, reading excluded."""
    import torch

    from llmexport.checkpoint import Checkpoint
    from llmexport.models import architecture_for
    from llmexport.quant.rtn import quantize_rtn
    from llmexport.quant.scheme import QuantScheme

    arch = architecture_for(Checkpoint.open(checkpoint))
    scheme, elapsed = QuantScheme(bits, block), 0.0
    for spec in arch.linears():
        weight, _ = arch.linear_weight(spec.name)
        start = time.perf_counter()
        if bits != 16:
            quantize_rtn(weight, bits, scheme.block_for(spec.in_features), False)
        else:
            weight.to(torch.float16)
        elapsed += time.perf_counter() - start
    tables = [t for t in ([] if arch.tied_embedding else [arch.embedding_table()]) + [arch.ple_table()] if t is not None]
    for table in tables:
        for chunk in table.row_chunks():
            start = time.perf_counter()
            if embed_bit != 16:
                quantize_rtn(chunk, embed_bit, block, False, scale_dtype=torch.float32)
            else:
                chunk.to(torch.bfloat16)
            elapsed += time.perf_counter() - start
    return elapsed


def _tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (from /proc)."""
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        try:
            with open(f"/proc/{current}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as f:
                    stack += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
    return total


def _run_export(checkpoint: Path, out: Path, args: argparse.Namespace) -> tuple[float, float, dict]:
    """Run the export CLI, sampling the RSS of its process tree every 50 ms."""
    cmd = [sys.executable, "-c", "from llmexport.cli import main; main()", "--path", str(checkpoint),
           "--dst_path", str(out), "--quant_bit", str(args.quant_bit), "--quant_block", str(args.quant_block),
           "--embed_bit", str(args.embed_bit)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, _tree_rss(proc.pid))
        time.sleep(0.05)
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"export failed:\n{stderr[-3000:]}")
    stages = json.loads(next(line for line in stdout.splitlines() if line.startswith("stages (s): "))[12:])
    return wall, peak / 2**30, stages


def _help_time() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "from llmexport.cli import main; main()", "--help"],
                   capture_output=True, check=True)
    return time.perf_counter() - start


_RUNTIME = r"""
import json, os, sys, time
import numpy as np
import MNN.llm as llm
start = time.perf_counter()
m = llm.create(sys.argv[1]); m.set_config({"thread_num": 2}); m.load()
load = time.perf_counter() - start
prompt = list(range(1000, 1000 + int(sys.argv[2])))
start = time.perf_counter(); logits = m.forward(prompt); np.array(logits.read()); prefill = time.perf_counter() - start
token = int(np.argmax(np.array(logits.read()))); steps = int(sys.argv[3])
start = time.perf_counter()
for _ in range(steps):
    token = int(np.argmax(np.array(m.forward([token]).read())))
decode = time.perf_counter() - start
print(json.dumps({"load_s": load, "prefill_tok_s": len(prompt) / prefill, "decode_tok_s": steps / decode}))
sys.stdout.flush(); os._exit(0)
"""


def _runtime_speed(out: Path, prompt: int = 64, steps: int = 32) -> dict:
    proc = subprocess.run([sys.executable, "-c", _RUNTIME, str(out / "config.json"), str(prompt), str(steps)],
                          capture_output=True, text=True)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("{")), None)
    return json.loads(line) if line else {"error": proc.stderr[-500:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quant_bit", type=int, default=4)
    parser.add_argument("--quant_block", type=int, default=64)
    parser.add_argument("--embed_bit", type=int, default=4)
    parser.add_argument("--no-runtime", action="store_true")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="llmexport-bench-")) / "out"

    wall, peak_gib, stages = _run_export(args.checkpoint, out, args)
    read_s, nbytes = _read_floor(args.checkpoint)
    kernel_s = _kernel_floor(args.checkpoint, args.quant_bit, args.quant_block, args.embed_bit)
    size = sum(p.stat().st_size for p in out.iterdir())
    floor = read_s + kernel_s
    print(f"checkpoint: {args.checkpoint} ({nbytes / 2**30:.2f} GiB)")
    print(f"export --quant_bit {args.quant_bit} --embed_bit {args.embed_bit}: wall {wall:.1f} s, "
          f"peak RSS {peak_gib:.2f} GiB, output {size / 2**30:.2f} GiB")
    print("stages (s): " + ", ".join(f"{k} {v:.1f}" for k, v in stages.items()))
    print(f"floor: read {read_s:.1f} s ({nbytes / 2**20 / read_s:.0f} MiB/s) + kernels {kernel_s:.1f} s "
          f"= {floor:.1f} s; wall/floor = {wall / floor:.2f}")
    print(f"llmexport --help: {_help_time():.2f} s")
    if not args.no_runtime:
        speed = _runtime_speed(out)
        print("runtime (2 threads): " + json.dumps({k: round(v, 2) if isinstance(v, float) else v
                                                   for k, v in speed.items()}))


if __name__ == "__main__":
    main()
