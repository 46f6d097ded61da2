"""The package's layers import one way: cli -> api -> pipeline -> the stages (source, models, planning,
calibration, trace, targets, mnn, verification), all on the neutral vocabulary of llmexport.spec; and no
two modules import each other, however indirectly.

Every module's imports are read with ``ast`` (top level and inside functions, which is where
slow imports hide, and where a circle between two modules of one layer can hide), so a back-edge
or a circle fails here rather than in review. docs/code-layout.md draws the same picture.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "llmexport"

#: module prefix -> llmexport modules it may import (prefixes; the most specific prefix rules). The
#: packages are the stages of the flow (docs/code-layout.md); a stage's lower modules (the vocabulary
#: others build on) have rules of their own, so that its upper ones may sit above other stages.
ALLOWED: dict[str, tuple[str, ...]] = {
    # the shared vocabulary
    "llmexport.spec": (),
    "llmexport.errors": (),
    "llmexport.progress": (),
    # where the weights come from: files, safetensors, a hub id; importers and adapters over them
    # (a new module of source/ imports nothing until it has its rule)
    "llmexport.source": (),
    "llmexport.source.input_files": ("llmexport.errors",),
    "llmexport.source.safetensors_file": ("llmexport.errors", "llmexport.source.input_files", "llmexport.spec"),
    "llmexport.source.checkpoint": ("llmexport.errors", "llmexport.source.input_files",
                                    "llmexport.source.safetensors_file", "llmexport.spec",
                                    "llmexport.source.importers.gguf"),
    # a hub repo id as --path: huggingface_hub's cache and download, the index read defensively; a GGUF
    # file as --path: its HF folder
    "llmexport.source.hub": ("llmexport.errors", "llmexport.source.input_files", "llmexport.progress",
                             "llmexport.source.importers.gguf"),
    # a GGUF file as the HF folder it was converted from: below the checkpoint, which reads its tensors
    "llmexport.source.importers.gguf": ("llmexport.source.importers.gguf", "llmexport.spec", "llmexport.errors",
                                        "llmexport.source.safetensors_file"),
    "llmexport.source.importers": ("llmexport.source.importers", "llmexport.spec", "llmexport.errors",
                                   "llmexport.source.checkpoint", "llmexport.source.safetensors_file",
                                   "llmexport.quant"),
    # a PEFT LoRA adapter as a WeightStore over the checkpoint's (merged as the tensors are read)
    "llmexport.source.lora": ("llmexport.source.lora", "llmexport.spec", "llmexport.errors",
                              "llmexport.source.checkpoint", "llmexport.source.safetensors_file",
                              "llmexport.source.input_files"),
    # the family over a checkpoint, an importer's store or an adapter: the top of source/
    "llmexport.source.loading": ("llmexport.source", "llmexport.models", "llmexport.spec", "llmexport.errors"),
    "llmexport.quant": ("llmexport.quant", "llmexport.spec", "llmexport.errors", "llmexport.mnn.limits"),
    "llmexport.mnn": ("llmexport.mnn", "llmexport.spec", "llmexport.errors", "llmexport.quant",
                      "llmexport.source.input_files", "llmexport.trace.ops"),
    # MNN's format limits and config keys, read by the options that are checked against them
    "llmexport.mnn.limits": (),
    "llmexport.mnn.config": (),
    # placeholder ops: what the families' rewrites are made of (their eager path and ONNX symbolic)
    "llmexport.trace.ops": ("llmexport.spec",),
    # the rewrite run eagerly and traced to ONNX
    "llmexport.trace": ("llmexport.trace", "llmexport.spec", "llmexport.models", "llmexport.source.checkpoint",
                        "llmexport.source.safetensors_file"),
    "llmexport.media": ("llmexport.media", "llmexport.errors"),
    # remote modeling code a family's reference runs (K2-Horizon)
    "llmexport.reference": ("llmexport.reference",),
    # HF's reference streamed block by block (calibration, the plan's memory, verification)
    "llmexport.reference.streamed": ("llmexport.spec", "llmexport.models", "llmexport.quant"),
    # (and the leaf mnn.config: a family declares its config.json keys, e.g. its activation precision)
    "llmexport.models": ("llmexport.models", "llmexport.spec", "llmexport.errors", "llmexport.source.checkpoint",
                         "llmexport.source.safetensors_file", "llmexport.source.input_files", "llmexport.trace.ops",
                         "llmexport.media", "llmexport.reference.k2_horizon", "llmexport.mnn.config"),
    # MNN 3.6.1's template engine versus Jinja2, which the families' chat-template modules build on
    "llmexport.models.chat_templates": ("llmexport.errors",),
    "llmexport.tiny": ("llmexport.tiny", "llmexport.reference.k2_horizon", "llmexport.mnn.tokenizer.pipeline",
                       "llmexport.mnn.tokenizer.byte_level", "llmexport.verification.quality",
                       "llmexport.source.importers.gguf.tokenizer"),
    # make demo: trains with tiny/, exports through the command line, generates with MNN's runtime
    "llmexport.demo": ("llmexport.tiny", "llmexport.mnn"),
    "llmexport.options": ("llmexport.options", "llmexport.errors", "llmexport.spec", "llmexport.quant",
                          "llmexport.mnn.limits", "llmexport.mnn.config"),
    # the typed plan and reports
    "llmexport.results": ("llmexport.spec", "llmexport.mnn.config", "llmexport.quant",
                          "llmexport.verification.quality"),
    # the user's text files (--calib_data, --verify_text)
    "llmexport.calibration.data": ("llmexport.errors", "llmexport.options"),
    # GPTQ, AWQ / SmoothQuant scales, --target_bpw's sensitivities: on the streamed reference
    "llmexport.calibration": ("llmexport.calibration", "llmexport.spec", "llmexport.errors", "llmexport.options",
                              "llmexport.quant", "llmexport.models", "llmexport.reference.streamed",
                              "llmexport.source.checkpoint", "llmexport.source.safetensors_file"),
    # every tensor's scheme, each linear's weights, the bytes and the memory (export_plan sums them
    # up with the output target's sizes: it alone may ask targets/)
    "llmexport.planning": ("llmexport.planning", "llmexport.spec", "llmexport.errors", "llmexport.options",
                           "llmexport.results", "llmexport.quant", "llmexport.mnn.limits", "llmexport.mnn.config",
                           "llmexport.mnn.token_table", "llmexport.models", "llmexport.source",
                           "llmexport.calibration", "llmexport.reference.streamed"),
    "llmexport.planning.export_plan": ("llmexport.planning", "llmexport.spec", "llmexport.options",
                                       "llmexport.results", "llmexport.quant", "llmexport.models",
                                       "llmexport.source", "llmexport.targets"),
    # one OutputTarget per --export format, and the destination it is swapped into
    "llmexport.targets": ("llmexport.targets", "llmexport.spec", "llmexport.errors", "llmexport.options",
                          "llmexport.results", "llmexport.progress", "llmexport.quant", "llmexport.mnn",
                          "llmexport.models", "llmexport.source", "llmexport.trace", "llmexport.calibration",
                          "llmexport.planning.schemes", "llmexport.planning.memory_plan",
                          "llmexport.planning.weight_sources", "llmexport.planning.digests"),
    "llmexport.targets.staging": ("llmexport.errors",),
    # llama.cpp's quality numbers: numpy only (the trainer scores its held-out text with them)
    "llmexport.verification.quality": (),
    "llmexport.verification": ("llmexport.verification", "llmexport.spec", "llmexport.errors", "llmexport.options",
                               "llmexport.results", "llmexport.mnn", "llmexport.models", "llmexport.source",
                               "llmexport.reference.streamed", "llmexport.calibration.data",
                               "llmexport.planning.memory_plan"),
}
#: what nothing below the entry points may import
ENTRY_POINTS = {"llmexport.cli": 0, "llmexport.run_cli": 0, "llmexport.demo": 0, "llmexport.api": 1,
                "llmexport.pipeline": 2}
#: import circles older than their check, to be broken (a new circle fails; so does one of these once
#: it is gone, until it leaves this list)
KNOWN_CYCLES: list[set[str]] = []


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return out


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks (annotations only, never run)."""
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            ids.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return ids


def _imports(module: str, path: Path) -> set[str]:
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    annotations_only = _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in annotations_only:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if base == "llmexport")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):  # importlib.import_module("x"), __import__("x")
            func = node.func
            if (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)) in (
                    "import_module", "__import__"):
                found.add(node.args[0].value)
    return {name for name in found if name == "llmexport" or name.startswith("llmexport.")}


def _rule(module: str) -> tuple[str, ...] | None:
    prefixes = [p for p in ALLOWED if module == p or module.startswith(p + ".")]
    return ALLOWED[max(prefixes, key=len)] if prefixes else None


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _import_graph(modules: list[tuple[str, Path]]) -> dict[str, set[str]]:
    """module -> the modules among ``modules`` it imports (a name imported from a module counts as
    that module)."""
    names = {m for m, _ in modules}

    def resolve(name: str) -> str | None:
        while name and name not in names:
            name = name.rpartition(".")[0]
        return name or None

    return {m: {r for n in _imports(m, p) if (r := resolve(n)) is not None and r != m} for m, p in modules}


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The circles of ``graph``: each set of two or more modules that all reach each other."""
    reach = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        reach[start] = seen
    circles: list[set[str]] = []
    for m in sorted(graph):
        circle = {m} | {n for n in reach[m] if m in reach[n]}
        if len(circle) > 1 and circle not in circles:
            circles.append(circle)
    return circles


MODULES = _modules()
RULED = [(m, p) for m, p in MODULES if _rule(m) is not None]


@pytest.mark.parametrize("module,path", RULED, ids=[m for m, _ in RULED])
def test_module_imports_only_its_layer_and_below(module, path):
    allowed = _rule(module)
    assert allowed is not None
    bad = sorted(name for name in _imports(module, path) if not _within(name, allowed + (module,)))
    assert not bad, f"{module} imports {bad}; its layer may import only {list(allowed)}"


BELOW_FACADE = [(m, p) for m, p in MODULES if m != "llmexport"]  # the package re-exports the API


@pytest.mark.parametrize("module,path", BELOW_FACADE, ids=[m for m, _ in BELOW_FACADE])
def test_nothing_imports_an_entry_point_above_it(module, path):
    rank = min((r for name, r in ENTRY_POINTS.items() if module == name), default=len(ENTRY_POINTS))
    bad = sorted(name for name in _imports(module, path)
                 for entry, r in ENTRY_POINTS.items() if r < rank and _within(name, (entry,)))
    assert not bad, f"{module} imports {bad}: the flow is cli -> api -> pipeline, never back"


def test_every_module_has_a_rule():
    """Every module but the entry points (ordered by the test above) and the package's facade has a
    rule: a new module or subpackage must say where it stands."""
    missing = [m for m, _ in MODULES if _rule(m) is None and m != "llmexport" and m not in ENTRY_POINTS]
    assert not missing, f"modules without a layer rule: {missing}"


def test_the_reader_sees_every_form_of_import(tmp_path):
    """The check itself: imports inside functions, relative ones, ``from llmexport import x``, and
    literal ``importlib.import_module`` are found; those only for type checking are not."""
    source = tmp_path / "llmexport" / "models"
    source.mkdir(parents=True)
    path = source / "x.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from llmexport.api import z\n"
                    "def f():\n    from llmexport.mnn.runtime import run_module\nfrom ..verification import y\n"
                    "import llmexport.trace.ops\nfrom llmexport import cli\n"
                    "def g():\n    import importlib\n    importlib.import_module('llmexport.mnn.convert')\n")
    assert _imports("llmexport.models.x", path) == {"llmexport.mnn.runtime", "llmexport.verification",
                                                    "llmexport.trace.ops", "llmexport", "llmexport.cli",
                                                    "llmexport.mnn.convert"}


def test_no_module_imports_itself_back():
    """No circle of imports between llmexport's modules, top level or inside functions: what two
    modules both need lives in a third that both import."""
    cycles = _cycles(_import_graph(MODULES))
    new = [sorted(c) for c in cycles if c not in KNOWN_CYCLES]
    assert not new, f"import circles: {new}; move what both sides need into a module both import"
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in cycles]
    assert not gone, f"{gone} no longer import each other: remove them from KNOWN_CYCLES"


def test_a_circle_through_a_function_level_import_is_found(tmp_path):
    package = tmp_path / "llmexport"
    package.mkdir()
    (package / "a.py").write_text("from llmexport.b import f\n")
    (package / "b.py").write_text("def f():\n    from llmexport.c import g\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import llmexport.b\n"
                                  "def g():\n    from llmexport import a\n")
    (package / "d.py").write_text("import llmexport.a\n")
    modules = [(f"llmexport.{name}", package / f"{name}.py") for name in "abcd"]
    assert _cycles(_import_graph(modules)) == [{"llmexport.a", "llmexport.b", "llmexport.c"}]
