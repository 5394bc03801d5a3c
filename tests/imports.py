"""The project's import graph, read from the source with ``ast`` (nothing is
imported): which project files a module imports, and the closure of a stage.

``tests/test_deps.py`` checks ``dvc.yaml`` against the closures and
``tests/test_project.py`` checks the graph's shape (layers, cycles).
"""

from __future__ import annotations

import ast
import sys
from functools import lru_cache
from pathlib import Path
from typing import Iterator

from tests.conftest import ROOT

PACKAGES = ("pipeline", "stages", "flows")  # the project's own top-level packages


def module_file(module: str) -> Path | None:
    """``pipeline.data`` -> pipeline/data/__init__.py, ``pipeline.files`` -> pipeline/files.py,
    anything else (a class, a third-party module) -> None."""
    if module.split(".")[0] not in PACKAGES:
        return None
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(body: list[ast.stmt], module_level_only: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements that run: ``if TYPE_CHECKING:`` bodies are skipped, and
    with ``module_level_only`` so are function bodies (they run on call, not on import)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_nodes(node.orelse, module_level_only)
        elif module_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                children = getattr(node, field, None)
                if isinstance(children, list):
                    yield from _import_nodes([c for c in children if isinstance(c, ast.AST)], module_level_only)


@lru_cache(maxsize=None)
def imported_modules(path: Path, module_level_only: bool = False) -> frozenset[str]:
    """The project modules ``path`` names in its imports: ``import a.b`` -> a.b;
    ``from a import b`` -> a.b when a/b is a module, else a (b is a name in it).
    Relative imports resolve against ``path``'s package."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    modules: set[str] = set()
    for node in _import_nodes(tree.body, module_level_only):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package[: len(package) - (node.level - 1)]
            base = ".".join([*anchor, *([base] if base else [])])
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            modules.add(sub if module_file(sub) is not None else base)
    return frozenset(m for m in modules if module_file(m) is not None)


@lru_cache(maxsize=None)
def imported_files(path: Path, module_level_only: bool = False) -> frozenset[Path]:
    """The project files whose code runs when ``path``'s imports run: each imported
    module and the package ``__init__.py`` files on its way."""
    files: set[Path] = set()
    for module in imported_modules(path, module_level_only):
        parts = module.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__.py and a/b/__init__.py first
            found = module_file(".".join(parts[:i]))
            if found is not None:
                files.add(found)
    files.discard(path)
    return frozenset(files)


def closure(start: Path, stop_at: callable = lambda path: False) -> set[Path]:
    """Every project file reachable from ``start`` through imports (inside functions
    too), ``start`` included. A file for which ``stop_at`` is true is included but
    not followed: what it imports it imports on its own behalf."""
    seen: set[Path] = set()
    todo = [start]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        if path == start or not stop_at(path):
            todo.extend(imported_files(path))
    return seen


@lru_cache(maxsize=None)
def third_party_imports(path: Path, module_level_only: bool = False) -> frozenset[str]:
    """The top-level names of the libraries ``path`` imports (``from torch.nn import
    x`` -> torch): neither the standard library nor the project's own packages."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in _import_nodes(tree.body, module_level_only):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return frozenset(n for n in names if n not in sys.stdlib_module_names and n not in PACKAGES
                     and n != "__future__")


def pipeline_modules() -> list[Path]:
    return sorted(p for p in (ROOT / "pipeline").rglob("*.py") if "__pycache__" not in p.parts)
