"""MNN's converter, called through the PyPI package's ``_tools.mnnconvert`` entry.

The converter runs in a child process: it prints to the C-level stdout, can abort the process
on bad input, and its Python wrapper (``MNN.tools.mnnconvert``) phones home and pip-installs
packages, so we never import that wrapper. The child's output is kept and its tail is shown
when a conversion fails.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

from llmexport.errors import ConversionError
from llmexport.mnn.exact_floats import restore_exact_floats

log = logging.getLogger(__name__)

# The entry returns True whether or not it converted anything: success is judged by the
# output file it was asked to write.
_RUNNER = "import sys, _tools\n_tools.mnnconvert(sys.argv[1:])\n"


def run_converter(argv: list[str], expect: Path) -> str:
    """Run ``MNNConvert argv`` and return its log; fail unless ``expect`` was written."""
    if expect.exists():
        expect.unlink()
    # argv[0] is the program name, as for the MNNConvert binary.
    proc = subprocess.run([sys.executable, "-c", _RUNNER, "MNNConvert", *argv],
                          capture_output=True, text=True, errors="replace")
    output = proc.stdout + proc.stderr
    log.debug("MNNConvert %s\n%s", " ".join(argv), output)
    if proc.returncode != 0 or not expect.exists() or expect.stat().st_size == 0:
        tail = "\n".join(output.strip().splitlines()[-15:])
        raise ConversionError(f"MNN converter failed (exit {proc.returncode}) on "
                              f"{' '.join(argv[:4])}:\n{tail}")
    return output


def onnx_to_mnn(onnx_path: Path, mnn_path: Path) -> None:
    run_converter(["-f", "ONNX", "--modelFile", str(onnx_path), "--MNNModel", str(mnn_path),
                   "--allowCustomOp", "--transformerFuse", "--saveExternalData"], mnn_path)


def mnn_to_json(mnn_path: Path, json_path: Path) -> dict[str, Any]:
    """The graph as JSON, every float exactly as ``mnn_path`` stores it (the dump rounds them to
    six decimals: llmexport.mnn.exact_floats)."""
    run_converter(["-f", "MNN", "--modelFile", str(mnn_path), "--JsonFile", str(json_path)], json_path)
    return restore_exact_floats(json.loads(json_path.read_text()), mnn_path)


def json_to_mnn(graph: dict[str, Any], json_path: Path, mnn_path: Path) -> None:
    # json.dumps writes each float as the shortest decimal that reads back as the same float64,
    # so the converter's parser recovers every float32 of the graph exactly.
    json_path.write_text(json.dumps(graph))
    run_converter(["-f", "JSON", "--modelFile", str(json_path), "--MNNModel", str(mnn_path)], mnn_path)
