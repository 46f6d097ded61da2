"""Where a GGUF model comes from: a model split into parts by llama.cpp's converter
(``--split-max-tensors``), read from its first part as the single file is; ``--gguf_file`` naming
one file of a folder; the errors for a wrong part, a missing part, a wrong name. (A hub repo of
GGUF files: tests/test_hub.py.)"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from gguf_fixtures import gguf_views, split_gguf

from llmexport.api import plan
from llmexport.cli import main
from llmexport.errors import InputError, UsageError
from llmexport.options import ExportOptions
from llmexport.source.hub import resolve_source
from llmexport.source.importers.gguf.file import GgufFile


@pytest.fixture(scope="session")
def ggufs(tmp_path_factory):
    yield from gguf_views(tmp_path_factory)


@pytest.fixture(scope="module")
def split(ggufs):
    """(first part of the tiny Llama's q8_0 split into 4 parts, the same model as one file)."""
    first = split_gguf("llama", "q8_0", 12)
    return first, ggufs("llama", "q8_0")[0]


def test_a_split_model_reads_as_the_single_file(split):
    first, single = split
    parts, whole = GgufFile(first), GgufFile(single)
    assert len(sorted(first.parent.glob("model-*-of-00004.gguf"))) == 4
    assert set(parts.tensors) == set(whole.tensors)
    for name, tensor in whole.tensors.items():
        assert parts.tensors[name].kind == tensor.kind and np.array_equal(parts.tensors[name].data, tensor.data)
    assert {k: v for k, v in parts.metadata.items() if not k.startswith(("split.", "GGUF."))} == \
        {k: v for k, v in whole.metadata.items() if not k.startswith(("split.", "GGUF."))}
    # its HF view, and the export's plan, are the single file's
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        assert json.loads((resolve_source(first).folder / name).read_text()) == \
            json.loads((resolve_source(single).folder / name).read_text()), name
    a, b = plan(first, ExportOptions()), plan(single, ExportOptions())
    assert (a.linears, a.tables, a.estimated_bytes) == (b.linears, b.tables, b.estimated_bytes)
    assert a.prequantized is not None and a.prequantized.to_json() == b.prequantized.to_json()


def test_a_folder_of_parts_is_the_model_and_wrong_parts_are_named(split, tmp_path):
    first, _ = split
    folder = tmp_path / "parts"
    shutil.copytree(first.parent, folder)
    assert GgufFile(resolve_source(folder).folder / "model.gguf").tensors.keys() == GgufFile(first).tensors.keys()
    with pytest.raises(InputError, match=r"model-00002-of-00004\.gguf: part 2 of a split GGUF model; pass its "
                                         r"first part, model-00001-of-00004\.gguf$"):
        GgufFile(folder / "model-00002-of-00004.gguf")
    (folder / "model-00003-of-00004.gguf").unlink()
    with pytest.raises(InputError, match=r"model-00003-of-00004\.gguf: no such GGUF file$"):
        GgufFile(folder / "model-00001-of-00004.gguf")
    shutil.copy(first.parent / "model-00004-of-00004.gguf", folder / "model-00003-of-00004.gguf")
    with pytest.raises(InputError, match=r"model-00003-of-00004\.gguf: metadata .*expected part 2 \(0-based\) of 4"):
        GgufFile(folder / "model-00001-of-00004.gguf")
    shutil.copy(first, folder / "alone-00001-of-00002.gguf")  # says 4 parts inside, 2 by its name
    with pytest.raises(InputError, match=r"alone-00001-of-00002\.gguf: metadata split\.no 0, split\.count 4; its "
                                         r"name says part 1 of 2$"):
        GgufFile(folder / "alone-00001-of-00002.gguf")


def test_gguf_file_names_one_file_of_a_folder(ggufs, tmp_path):
    q8, _ = ggufs("llama", "q8_0")
    q41, _ = ggufs("llama", "Q4_1")
    folder = tmp_path / "repo"
    folder.mkdir()
    shutil.copy(q8, folder / "tiny-Q8_0.gguf")
    shutil.copy(q41, folder / "tiny-Q4_1.gguf")
    (folder / "README.md").write_text("# two quantizations")
    with pytest.raises(InputError, match=r"holds 2 GGUF models \(tiny-Q4_1\.gguf, tiny-Q8_0\.gguf\); name one "
                                         r"with --gguf_file"):
        resolve_source(folder)
    chosen = plan(folder, ExportOptions(gguf_file="tiny-Q4_1.gguf"))
    assert chosen.prequantized is not None and chosen.prequantized.transcoded > 0
    assert {(linear.bits, linear.sym) for linear in chosen.linears if linear.method.value == "stored"} == {(4, False)}
    with pytest.raises(InputError, match=r"^--path .*repo: no GGUF file tiny-Q6_K\.gguf \(its GGUF files: "
                                         r"tiny-Q4_1\.gguf, tiny-Q8_0\.gguf\)$"):
        resolve_source(folder, gguf_file="tiny-Q6_K.gguf")
    for bad in ("README.md", "../x.gguf", "/abs/x.gguf"):
        with pytest.raises(UsageError, match=r"^--gguf_file .*: expected the name of a \.gguf file inside"):
            resolve_source(folder, gguf_file=bad)
    with pytest.raises(UsageError, match=r"^--gguf_file x\.gguf: names a file in a folder or hub repo; --path .* is "
                                         r"a file$"):
        resolve_source(folder / "tiny-Q8_0.gguf", gguf_file="x.gguf")
    # on the command line: the dry run of the named file, and a missing name is an input error writing nothing
    result = CliRunner().invoke(main, ["--path", str(folder), "--gguf_file", "tiny-Q8_0.gguf", "--dst_path",
                                       str(tmp_path / "out"), "--dry-run"])
    assert result.exit_code == 0 and "Q8_0" in result.output, result.output
    result = CliRunner().invoke(main, ["--path", str(folder), "--gguf_file", "nope.gguf", "--dst_path",
                                       str(tmp_path / "out")])
    assert result.exit_code == InputError.exit_code and "no GGUF file nope.gguf" in result.output
    assert not (tmp_path / "out").exists()
