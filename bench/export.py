"""Export benchmark: wall time per stage against the read and kernel floors, peak RSS, size, runtime speed.

    python bench/export.py CHECKPOINT [--out DIR] [--quant_bit 4] [--embed_bit 4] [--cache cold warm]
                           [--no-runtime]

Everything is measured in this one run, side by side, per page-cache state (``--cache``):
- ``cold``: the checkpoint's pages are dropped from the page cache (``posix_fadvise DONTNEED`` on
  its files: nothing else is evicted) before the read floor and again before the export;
  ``warm``: the checkpoint is read once before each. The resident share of the checkpoint is
  printed before each measurement (``fincore``), so the state both ran in is visible;
- the read floor: every byte of the checkpoint read once into one reused buffer;
- the export, run as ``llmexport`` in a child process: wall time, the wall time of each stage it
  reports and its peak RSS (the largest of it and the converter processes it starts);
- the kernel floor: the bare quantization kernels on every linear and table, run as the export
  runs them (row slices on the quantization workers), the tensors already in memory;
- wall / read floor and wall / (read + kernel floor); the export size; ``llmexport --help``
  start-up time; MNN's runtime on the export (bench/runtime.py: load, prefill, decode at 2 threads).
Where ``chrt`` may, the floors and the export run under SCHED_RR, so that other processes on a
shared machine do not stretch them (the same for all, so the ratios compare like with like).
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime import realtime_prefix, runtime_speed  # noqa: E402

_READ_FLOOR = r"""
import sys, time
from pathlib import Path
buf, total = bytearray(64 << 20), 0
start = time.perf_counter()
for file in sorted(Path(sys.argv[1]).glob("*.safetensors")):
    with open(file, "rb", buffering=0) as f:
        while (n := f.readinto(buf)) > 0:
            total += n
print(time.perf_counter() - start, total)
"""


def _files(checkpoint: Path) -> list[Path]:
    return sorted(checkpoint.glob("*.safetensors"))


def set_cache(checkpoint: Path, state: str) -> None:
    """Drop the checkpoint from the page cache (cold) or read it once (warm)."""
    for file in _files(checkpoint):
        fd = os.open(file, os.O_RDONLY)
        try:
            if state == "cold":
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            else:
                while os.read(fd, 64 << 20):
                    pass
        finally:
            os.close(fd)


def resident_share(checkpoint: Path) -> float | None:
    """Fraction of the checkpoint's bytes in the page cache (util-linux ``fincore``), if known."""
    files = _files(checkpoint)
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, files)],
                             capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return None
    return sum(int(v) for v in out) / max(1, sum(f.stat().st_size for f in files))


def read_floor(checkpoint: Path, prefix: list[str]) -> tuple[float, int]:
    out = subprocess.run(prefix + [sys.executable, "-c", _READ_FLOOR, str(checkpoint)], capture_output=True,
                         text=True, check=True).stdout.split()
    return float(out[0]), int(out[1])


def kernel_floor(checkpoint: Path, bits: int, block: int, embed_bit: int) -> float:
    """Bare quantization of every linear and table as the writers run it, reading excluded."""
    import torch

    from llmexport.mnn.token_table import token_table
    from llmexport.mnn.weights import _row_slices
    from llmexport.quant.rtn import quantize_rtn
    from llmexport.quant.scheme import QuantScheme
    from llmexport.quant.workers import map_ordered
    from llmexport.source.checkpoint import Checkpoint
    from llmexport.source.loading import open_architecture

    def timed(weight, bits: int, block: int, scale_dtype) -> float:
        start = time.perf_counter()
        if bits == 16:
            weight.to(torch.float16)
        else:
            for _ in map_ordered(lambda rows: quantize_rtn(weight[rows], bits, block, False, scale_dtype),
                                 _row_slices(*weight.shape)):
                pass
        return time.perf_counter() - start

    arch = open_architecture(Checkpoint.open(checkpoint))
    scheme, elapsed = QuantScheme(bits, block), 0.0
    for spec in arch.linears():
        elapsed += timed(arch.linear_weight(spec.name)[0], bits, scheme.block_for(spec.in_features), torch.float16)
    table = token_table(arch)
    tables = [] if table is None else [table]
    for table in tables:
        for chunk in table.row_chunks():
            elapsed += timed(chunk, embed_bit, block, torch.float32)
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


def run_export(checkpoint: Path, out: Path, args: argparse.Namespace, prefix: list[str]) -> tuple[float, float, dict]:
    """Run the export CLI, sampling the RSS of its process tree every 50 ms."""
    cmd = prefix + [sys.executable, "-c", "from llmexport.cli import main; main()", "--path", str(checkpoint),
                    "--dst_path", str(out), "--quant_bit", str(args.quant_bit), "--quant_block",
                    str(args.quant_block), "--embed_bit", str(args.embed_bit)]
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


def _share(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.0%}"


def _measure(state: str, args: argparse.Namespace, out: Path, prefix: list[str]) -> dict:
    set_cache(args.checkpoint, state)
    before_read = resident_share(args.checkpoint)
    read_s, nbytes = read_floor(args.checkpoint, prefix)
    set_cache(args.checkpoint, state)
    before_export = resident_share(args.checkpoint)
    wall, peak_gib, stages = run_export(args.checkpoint, out, args, prefix)
    return {"cache": state, "resident_before_read": before_read, "resident_before_export": before_export,
            "read_s": read_s, "bytes": nbytes, "wall_s": wall, "peak_rss_gib": peak_gib, "stages": stages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quant_bit", type=int, default=4)
    parser.add_argument("--quant_block", type=int, default=64)
    parser.add_argument("--embed_bit", type=int, default=4)
    parser.add_argument("--cache", nargs="+", choices=["cold", "warm"], default=["cold", "warm"])
    parser.add_argument("--no-runtime", action="store_true")
    parser.add_argument("--kernel-floor-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="llmexport-bench-")) / "out"
    if args.kernel_floor_only:
        print(kernel_floor(args.checkpoint, args.quant_bit, args.quant_block, args.embed_bit))
        return
    prefix = realtime_prefix()
    runs = [_measure(state, args, out, prefix) for state in args.cache]
    set_cache(args.checkpoint, "warm")  # the kernel floor excludes reading: a child under the same scheduling
    kernel_s = float(subprocess.run(prefix + [sys.executable, __file__, str(args.checkpoint), "--kernel-floor-only",
                                              "--quant_bit", str(args.quant_bit), "--quant_block",
                                              str(args.quant_block), "--embed_bit", str(args.embed_bit)],
                                    capture_output=True, text=True, check=True).stdout.split()[-1])
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"checkpoint: {args.checkpoint} ({runs[0]['bytes'] / 2**30:.2f} GiB); realtime scheduling: {bool(prefix)}")
    print(f"export --quant_bit {args.quant_bit} --embed_bit {args.embed_bit}: output {size / 2**30:.2f} GiB; "
          f"kernel floor {kernel_s:.1f} s")
    for r in runs:
        floor = r["read_s"] + kernel_s
        print(f"[{r['cache']}] resident before read {_share(r['resident_before_read'])}, before export "
              f"{_share(r['resident_before_export'])}: read floor {r['read_s']:.1f} s "
              f"({r['bytes'] / 2**20 / r['read_s']:.0f} MiB/s); export wall {r['wall_s']:.1f} s, peak RSS "
              f"{r['peak_rss_gib']:.2f} GiB; wall/read = {r['wall_s'] / r['read_s']:.2f}, "
              f"wall/(read+kernels) = {r['wall_s'] / floor:.2f}")
        print(f"[{r['cache']}] stages (s): " + ", ".join(f"{k} {v:.1f}" for k, v in r["stages"].items()))
    print(f"llmexport --help: {_help_time():.2f} s")
    if not args.no_runtime:
        speed = runtime_speed(out, 2, prefix=prefix)
        print("runtime (2 threads): " + json.dumps({k: round(v, 2) if isinstance(v, float) else v
                                                   for k, v in speed.items()}))


if __name__ == "__main__":
    main()
