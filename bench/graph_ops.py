"""Op types of exported graphs, side by side (docs/benchmarks.md, "Against MNN's own exporter, measured").

    python bench/graph_ops.py EXPORT_DIR_OR_MNN [EXPORT_DIR_OR_MNN ...]

Each argument is an export folder (its ``llm.mnn``) or a ``.mnn`` file; the graph is dumped to JSON
by MNN's converter (llmexport.mnn.convert.mnn_to_json) and its ops counted by type, MoE subgraphs
included. Prints a markdown table: one column per graph, the total first, then every op type, most
frequent first. Used to compare our export with MNN's own exporter's output of the same checkpoint.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmexport.mnn.convert import mnn_to_json  # noqa: E402


def op_counts(path: Path) -> Counter:
    """{op type: count} of the graph at ``path`` (an export folder or a .mnn file)."""
    graph = path / "llm.mnn" if path.is_dir() else path
    with tempfile.TemporaryDirectory(prefix="llmexport-graph-ops-") as tmp:
        data = mnn_to_json(graph, Path(tmp) / "graph.json")
    ops = list(data["oplists"]) + [op for sub in data.get("subgraphs", []) for op in sub.get("nodes", [])]
    return Counter(op["type"] for op in ops)


def table(counts: dict[str, Counter]) -> list[str]:
    kinds = sorted(set().union(*counts.values()), key=lambda k: (-max(c[k] for c in counts.values()), k))
    rows = ["| op | " + " | ".join(counts) + " |", "|" + " --- |" * (len(counts) + 1),
            "| all | " + " | ".join(str(sum(c.values())) for c in counts.values()) + " |"]
    rows += [f"| {kind} | " + " | ".join(str(c[kind]) for c in counts.values()) + " |" for kind in kinds]
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("graphs", type=Path, nargs="+")
    args = parser.parse_args(argv)
    counts = {str(path): op_counts(path) for path in args.graphs}
    print("\n".join(table(counts)))


if __name__ == "__main__":
    main()
