"""The exporter source behind a golden: {path: sha256} of a component's module and of every goldens/
module it imports, transitively (goldens.tolerances aside: the entry records its own bounds).
The model under test is not the exporter: the entry's `config` and `versions` record the rest.
"""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "goldens"
NOT_SOURCE = ("goldens.tolerances",)
"""Modules an exporter imports whose changes do not change what it exports."""


def module_path(module: str) -> Path | None:
    """goldens.x.y -> goldens/x/y.py (or its package's __init__.py); None outside goldens/."""
    if module.split(".")[0] != PACKAGE or module in NOT_SOURCE:
        return None
    base = REPO.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def imported_modules(tree: ast.Module) -> set[str]:
    """Absolute module names an AST imports (`from a import b`: a, and a.b where b is a module)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def exporter_source(module: str) -> dict[str, str]:
    """{repo path: sha256} of `module` and the goldens/ modules it imports, transitively."""
    found, todo = {}, [module]
    while todo:
        path = module_path(todo.pop())
        if path is None or (rel := path.relative_to(REPO).as_posix()) in found:
            continue
        text = path.read_bytes()
        found[rel] = hashlib.sha256(text).hexdigest()
        todo.extend(imported_modules(ast.parse(text)))
    return dict(sorted(found.items()))
