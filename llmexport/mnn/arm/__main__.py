"""``python -m llmexport.mnn.arm`` (``make arm-runtime``): set up the ARM runtime and prove it starts.

Prints the machine and how long its interpreter takes to start and import numpy and MNN (the fixed
cost of every emulated child); exits 1 with one line when the emulator is missing or a set-up fails.
"""

from __future__ import annotations

import subprocess
import sys
import time

from llmexport.errors import LlmExportError
from llmexport.mnn.arm.machine import arm_machine

_PROBE = "import numpy, MNN; print('numpy', numpy.__version__, 'MNN', MNN.version())"


def main() -> int:
    try:
        machine = arm_machine()
    except LlmExportError as exc:
        print(f"arm-runtime: {exc}", file=sys.stderr)
        return 1
    started = time.perf_counter()
    proc = subprocess.run([*machine.interpreter, "-c", _PROBE], env=machine.environment(), capture_output=True,
                          text=True)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"arm-runtime: {machine.name} does not start: {last}", file=sys.stderr)
        return 1
    print(f"arm-runtime: {machine.name}: {proc.stdout.strip()}, start + import {seconds:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
