"""Time two variants of MNN's CPU linear side by side (bench/linear_op.py's one-op graphs).

    python bench/linear_speed.py [--compare stride|dynamic_option] [--rows 1 512] [--in 1536]
                                 [--out 2048] [--weights 16 4] [--memory normal low] [--threads 1]
                                 [--repeats 30]

For each weight kind and memory mode, a baseline (the 1x1 Convolution at stride 1, runtime hint
``dynamic_option`` 0) and a candidate are loaded into one process and run alternately, the order
swapped every round, ``--repeats`` rounds after a warm-up; reported: the median time of each and
the ratio candidate / baseline. Candidates: ``stride`` = the convolution at stride 2 (the same
output on the 1x1 plane; MNN's CPU backend then takes its tiled GEMM instead of the Strassen 1x1
executor); ``dynamic_option`` = the hint at 2 (the low-memory int8 kernels quantize their input
per weight block). On a shared machine only the ratio means anything.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from linear_op import inputs  # noqa: E402

from llmexport.mnn.linear_graph import linear_model  # noqa: E402
from llmexport.quant.scheme import QuantScheme  # noqa: E402

_MEMORY = {"normal": 0, "high": 1, "low": 2}
_DYNAMIC_QUANT_OPTIONS = 5  # Interpreter::HintMode


def _load(model: Path, memory: str, threads: int, dynamic_option: int):
    import MNN.nn as nn

    runtime = nn.create_runtime_manager(({"backend": "CPU", "numThread": threads, "precision": 0,
                                          "memory": _MEMORY[memory]},))
    runtime.set_hint(_DYNAMIC_QUANT_OPTIONS, dynamic_option)
    return nn.load_module_from_file(str(model), ["x"], ["y"], runtime_manager=runtime)


def _timed(module, x: np.ndarray) -> float:
    import MNN.expr as F

    var = F.const(x, list(x.shape), F.NCHW, F.float)
    start = time.perf_counter()
    out = module.forward([var])
    out = out[0] if isinstance(out, (list, tuple)) else out
    out.read()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", choices=["stride", "dynamic_option"], default="stride")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 512])
    parser.add_argument("--in", dest="ic", type=int, default=1536)
    parser.add_argument("--out", dest="oc", type=int, default=2048)
    parser.add_argument("--weights", type=int, nargs="+", default=[16, 4])
    parser.add_argument("--memory", nargs="+", choices=sorted(_MEMORY), default=["normal", "low"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    print(f"in {args.ic}, out {args.oc}, {args.threads} thread(s), {args.repeats} alternating rounds")
    candidate = "stride 2" if args.compare == "stride" else "dynamic_option 2"
    print(f"| rows | weights | memory | baseline (median ms) | {candidate} (median ms) | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="llmexport-linear-speed-") as tmp:
        for bits in args.weights:
            _, w = inputs(1, args.ic, args.oc)
            strides = (False, args.compare == "stride")
            options = (0, 2 if args.compare == "dynamic_option" else 0)
            paths = [Path(tmp) / f"w{bits}_{i}.mnn" for i in (0, 1)]
            for path, strided in zip(paths, strides):
                linear_model(path, w, QuantScheme(bits=bits, block=64), strided)
            for memory in args.memory:
                modules = [_load(path, memory, args.threads, option) for path, option in zip(paths, options)]
                for rows in args.rows:
                    x, _ = inputs(rows, args.ic, args.oc)
                    times: list[list[float]] = [[], []]
                    for m in modules:  # warm-up: the first call resizes and packs
                        _timed(m, x)
                    for r in range(args.repeats):
                        order = (0, 1) if r % 2 == 0 else (1, 0)
                        for i in order:
                            times[i].append(_timed(modules[i], x))
                    med = [float(np.median(t)) * 1e3 for t in times]
                    print(f"| {rows} | {bits}-bit | {memory} | {med[0]:.3f} | {med[1]:.3f} | {med[1] / med[0]:.2f} |",
                          flush=True)
    sys.stdout.flush()
    os._exit(0)  # MNN can crash at interpreter exit (docs/MNN_RUNTIME_CONTRACT)


if __name__ == "__main__":
    main()
