"""One-way layering: architectures (llmexport/models/) describe, they never run MNN, verify,
export or parse flags. Every import of every module is checked, at the top and inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "llmexport"
#: what llmexport/models/ may not import: a module and its submodules; a trailing * also matches
#: longer names (llmexport.verification_media, llmexport.mnn_anything)
FORBIDDEN_IN_MODELS = ("llmexport.mnn*", "llmexport.verification*", "llmexport.pipeline", "llmexport.api",
                       "llmexport.cli")


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, module) for every import in ``path`` (a module of the package at ``root``):
    ``import a.b``, ``from a import b`` (as a and a.b: b may be a module), relative imports
    resolved, and ``importlib.import_module("a")`` / ``__import__("a")`` with a literal name."""
    package = _module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__"):
                found.append((node.lineno, node.args[0].value))
    return found


def forbidden(module: str, patterns: tuple[str, ...]) -> bool:
    return any(module.startswith(p[:-1]) if p.endswith("*") else module == p or module.startswith(p + ".")
               for p in patterns)


def test_the_import_scanner_sees_every_form(tmp_path):
    package = tmp_path / "llmexport" / "models"
    package.mkdir(parents=True)
    source = package / "probe.py"
    source.write_text("import llmexport.mnn.runtime\nfrom llmexport import api\nfrom .. import cli as c\n"
                      "def f():\n    from llmexport.verification_media import x\n    from ..pipeline import y\n"
                      "    import importlib\n    importlib.import_module('llmexport.mnn.convert')\n"
                      "from llmexport.models.base import Tower\nfrom llmexport import errors\n")
    hits = {line for line, module in imported_modules(source, tmp_path / "llmexport")
            if forbidden(module, FORBIDDEN_IN_MODELS)}
    assert sorted(hits) == [1, 2, 3, 5, 6, 8]
    assert forbidden("llmexport.mnn_tools", FORBIDDEN_IN_MODELS) and forbidden("llmexport.cli", FORBIDDEN_IN_MODELS)
    assert not any(forbidden(m, FORBIDDEN_IN_MODELS) for m in ("llmexport.media.image", "llmexport.apis", "mnn"))


@pytest.mark.parametrize("path", sorted((PACKAGE / "models").rglob("*.py")), ids=lambda p: p.name)
def test_models_import_no_runtime_verification_or_front_end(path):
    bad = [f"{path.relative_to(PACKAGE.parent)}:{line}: {module}" for line, module in imported_modules(path)
           if forbidden(module, FORBIDDEN_IN_MODELS)]
    assert not bad, "architectures must not import the MNN side, verification or the front end:\n" + "\n".join(bad)
