"""The examples stay runnable: the notebook executes end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml  # noqa: F401  (pyyaml comes with the notebook stack; checks the workflow parses)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.slow
def test_notebook_executes(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("LLMEXPORT_EXAMPLE_DIR", str(tmp_path))
    notebook = nbformat.read(EXAMPLES / "export_and_verify.ipynb", as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3").execute()
    assert (tmp_path / "logit_error.png").stat().st_size > 1000
    assert (tmp_path / "mnn" / "verify.json").exists()


def test_ci_workflow_is_valid_yaml():
    data = yaml.safe_load((EXAMPLES / "ci-conversion.yml").read_text())
    steps = data["jobs"]["convert"]["steps"]
    assert any("--verify" in step.get("run", "") for step in steps)
