"""bench/graph_ops.py: op types of a real MNN graph, counted and tabled."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np

from llmexport.mnn.linear_graph import linear_model
from llmexport.quant.scheme import QuantScheme

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import graph_ops  # noqa: E402


def test_counts_the_ops_of_a_one_linear_graph(tmp_path, capsys):
    weight = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    linear_model(tmp_path / "l.mnn", weight, QuantScheme(bits=4, block=32))
    counts = graph_ops.op_counts(tmp_path / "l.mnn")
    # the rebuild's linear: Reshape -> ConvertTensor -> Convolution -> ConvertTensor -> Reshape
    assert counts == Counter({"Input": 1, "Reshape": 2, "ConvertTensor": 2, "Convolution": 1})
    folder = tmp_path / "export"
    folder.mkdir()
    (tmp_path / "l.mnn").rename(folder / "llm.mnn")
    graph_ops.main([str(folder)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == "| all | 6 |"
    assert lines[3:5] == ["| ConvertTensor | 2 |", "| Reshape | 2 |"]
    assert "| Convolution | 1 |" in lines and len(lines) == 7
