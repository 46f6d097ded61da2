"""--verify at real size: wall time and peak memory of the verification beside the export's own.

    python bench/verify.py CHECKPOINT [--out DIR] [--quant_bit 4] [--embed_bit 4] [--runtime_profile fast]
                           [--keep]

Measured in this one run, side by side, each step in its own child process whose memory is
sampled every 50 ms (/proc: the process alone, and with every process it starts: MNN's converter
during the export, MNN's runtime during verification):
- the export: ``llmexport --path CHECKPOINT --dst_path OUT`` with the given scheme, no ``--verify``;
- the verification of that export: ``llmexport.verify(OUT, CHECKPOINT)``, what ``--verify`` runs
  after an export (the streamed HF references, llmexport/reference/streamed.py; the runtime's
  single-prompt runs, the conversation, the towers);
- the report: wall times and their ratio, peak RSS of each process alone and of its tree, the
  verification's peak above the export's, and the verification's own summary line.
Run it on a quiet machine: other processes stretch the wall times (the memory does not move).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from export import _tree_rss  # noqa: E402

GIB = 2**30
_VERIFY = """
import json, sys, time
import llmexport
report = llmexport.verify(sys.argv[1], sys.argv[2])
from llmexport.verification.verify import summary_line
print("SUMMARY " + summary_line(report))
print("PASSED " + json.dumps(report.passed))
"""


def _own_rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (FileNotFoundError, ProcessLookupError):
        return 0


def measured(cmd: list[str]) -> dict:
    """Run ``cmd``: wall time, peak RSS of the process alone and of its tree (GiB), its output."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    own = tree = 0
    while proc.poll() is None:
        own, tree = max(own, _own_rss(proc.pid)), max(tree, _tree_rss(proc.pid))
        time.sleep(0.05)
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    return {"wall_s": round(wall, 1), "peak_rss_gib": round(own / GIB, 2), "tree_peak_rss_gib": round(tree / GIB, 2),
            "stdout": stdout}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="export folder (default: a temporary one)")
    parser.add_argument("--quant_bit", default="4")
    parser.add_argument("--embed_bit", default="4")
    parser.add_argument("--runtime_profile", default="fast")
    parser.add_argument("--keep", action="store_true", help="keep the export")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="llmexport-bench-verify-"))
    out = args.out or work / "export"
    try:
        export = measured([sys.executable, "-c", "from llmexport.cli import main; main()", "--path",
                           str(args.checkpoint), "--dst_path", str(out), "--quant_bit", args.quant_bit,
                           "--embed_bit", args.embed_bit, "--runtime_profile", args.runtime_profile, "--quiet"])
        verify = measured([sys.executable, "-c", _VERIFY, str(out), str(args.checkpoint)])
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    lines = verify.pop("stdout").splitlines()
    export.pop("stdout")
    result = {"checkpoint": str(args.checkpoint), "scheme": f"--quant_bit {args.quant_bit} --embed_bit "
              f"{args.embed_bit} --runtime_profile {args.runtime_profile}", "export": export, "verify": verify,
              "verify_over_export_wall": round(verify["wall_s"] / export["wall_s"], 2),
              "verify_peak_above_export_gib": round(verify["peak_rss_gib"] - export["peak_rss_gib"], 2),
              "passed": json.loads(next(line for line in lines if line.startswith("PASSED "))[7:]),
              "summary": next(line for line in lines if line.startswith("SUMMARY "))[8:]}
    print(json.dumps(result, indent=2))
    print(f"\n| step | wall | peak RSS (process) | peak RSS (with its children) |\n| --- | --- | --- | --- |\n"
          f"| export | {export['wall_s']} s | {export['peak_rss_gib']} GiB | {export['tree_peak_rss_gib']} GiB |\n"
          f"| verify | {verify['wall_s']} s (x{result['verify_over_export_wall']}) | {verify['peak_rss_gib']} GiB "
          f"({result['verify_peak_above_export_gib']:+} GiB) | {verify['tree_peak_rss_gib']} GiB |")


if __name__ == "__main__":
    main()
