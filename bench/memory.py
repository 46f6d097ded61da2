"""Peak memory of an export (and of MNN's runtime on it), measured beside llmexport's estimate.

    python bench/memory.py CHECKPOINT [--runtime] [--prompt 520] [LLMEXPORT FLAGS ...]

- the export runs as ``llmexport`` in a child process; the resident memory of its process tree
  (the export and the converter it starts) is sampled every 10 ms, and its peak is reported per
  stage (from the stage log lines) beside ``plan.memory.export_bytes`` (llmexport/planning/memory_plan.py);
- ``--runtime``: MNN's runtime child (llmexport/mnn/runtime.py, as verification runs it: a
  ``--prompt``-token prompt, 24 forced and 24 greedy steps) on the export, with the shipped
  config.json and on the exact kernels, beside ``memory_plan.plan_runtime_bytes``.

Tree sums count a converter child's pages twice for the instant between its fork and its exec;
the per-stage peaks of the export's own process are printed too. The export is deleted after.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from export import _tree_rss  # noqa: E402

MIB = 1 << 20


def _own_rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * 4096
    except (FileNotFoundError, ProcessLookupError):
        return 0


def _sampled(cmd: list[str], stdin: str | None = None) -> tuple[dict[str, tuple[int, int]], str, int]:
    """Run ``cmd``; peak (tree, own) resident bytes per stage, the output, the exit code."""
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if stdin is not None:
        proc.stdin.write(stdin)  # type: ignore[union-attr]
    proc.stdin.close()  # type: ignore[union-attr]
    stage, lines = ["start"], []

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if " stage " in line and line.rstrip().endswith("..."):
                stage[0] = line.split(" stage ")[1].split()[0]

    reader = threading.Thread(target=read)
    reader.start()
    peaks: dict[str, tuple[int, int]] = {}
    while proc.poll() is None:
        tree, own = _tree_rss(proc.pid), _own_rss(proc.pid)
        old = peaks.get(stage[0], (0, 0))
        peaks[stage[0]] = (max(old[0], tree), max(old[1], own))
        time.sleep(0.01)
    reader.join()
    return peaks, "".join(lines), proc.returncode


def _plan(checkpoint: Path, flags: list[str]):
    import llmexport
    from llmexport.cli import export_options, parse_command

    command = parse_command(["--path", str(checkpoint), "--dst_path", "unused", *flags])
    return llmexport.plan(checkpoint, export_options(command).validate())


def _runtime(export: Path, prompt: int, config: dict) -> int:
    with tempfile.TemporaryDirectory(prefix="llmexport-bench-") as tmp:
        request = {"config": str(export / "config.json"), "prompt": list(range(100, 100 + prompt)),
                   "forced": list(range(700, 723)), "greedy": 24, "texts": ["hello"],
                   "set_config": {"thread_num": 2, **config}, "out": tmp}
        peaks, output, code = _sampled([sys.executable, "-m", "llmexport.mnn.runtime"], json.dumps(request))
        if code != 0:
            raise SystemExit(f"runtime failed:\n{output[-2000:]}")
    return max(tree for tree, _ in peaks.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--runtime", action="store_true")
    parser.add_argument("--prompt", type=int, default=520)
    args, flags = parser.parse_known_args()
    from llmexport.planning.memory_plan import plan_runtime_bytes

    plan = _plan(args.checkpoint, flags)
    out = Path(tempfile.mkdtemp(prefix="llmexport-bench-")) / "out"
    try:
        peaks, output, code = _sampled([sys.executable, "-c", "from llmexport.cli import main; main()", "--path",
                                        str(args.checkpoint), "--dst_path", str(out), *flags])
        if code != 0:
            raise SystemExit(f"export failed:\n{output[-3000:]}")
        peak = max(tree for tree, _ in peaks.values())
        assert plan.memory is not None
        print(f"export {args.checkpoint} {' '.join(flags)}: peak {peak / MIB:.0f} MiB, "
              f"estimated {plan.memory.export_bytes / MIB:.0f} MiB ({plan.memory.export_bytes / peak - 1:+.0%})")
        print("per stage, tree/own MiB: " + ", ".join(f"{name} {tree / MIB:.0f}/{own / MIB:.0f}"
                                                       for name, (tree, own) in peaks.items()))
        if args.runtime:
            from llmexport.mnn.config import EXACT_KERNELS

            for label, config in (("shipped config.json", {}), ("exact kernels", EXACT_KERNELS)):
                estimate = plan_runtime_bytes(plan, (out / "llm.mnn.weight").stat().st_size,
                                              exact=bool(config) or all(linear.bits >= 16 for linear in plan.linears))
                used = _runtime(out, args.prompt, config)
                print(f"runtime, {label}, {args.prompt}-token prompt: peak {used / MIB:.0f} MiB, estimated "
                      f"{estimate / MIB:.0f} MiB ({estimate / used - 1:+.0%})")
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
