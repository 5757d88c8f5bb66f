"""The layout: each folder is one layer and imports only the layers below it (model < goldens <
parity < bench, tests), `model/` imports nothing but jax, flax, optax, numpy and the standard
library, bench/ never imports tests/, and no module reaches for another's private name. Read with
`ast` from the sources, so a lazy import inside a function counts too."""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"model": 0, "goldens": 1, "parity": 2, "bench": 3, "tests": 3}
MODEL_THIRD_PARTY = {"jax", "flax", "optax", "numpy"}


def _imports(tree: ast.Module) -> list[tuple[str, list[str], int]]:
    """(module, names imported from it, line) of every absolute import."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module, [alias.name for alias in node.names], node.lineno))
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def violations(package: str, path: str, source: str) -> list[str]:
    """What a module of `package` at `path` does against the layout."""
    tree = ast.parse(source)
    found = []
    repo_modules = {}  # local name -> repo module, to see `module._private`
    for module, names, line in _imports(tree):
        top = module.split(".")[0]
        where = f"{path}:{line}"
        if top in LAYERS:
            if top != package and LAYERS[top] >= LAYERS[package]:
                found.append(f"{where}: {package}/ imports {module} (not a layer below it)")
            found += [f"{where}: imports private {module}.{n}" for n in names if _private(n)]
            repo_modules.update({n: f"{module}.{n}" for n in names})
        elif package == "model" and top not in MODEL_THIRD_PARTY | sys.stdlib_module_names:
            found.append(f"{where}: model/ imports {module}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and isinstance(node.value, ast.Name)
            and node.value.id in repo_modules
        ):
            found.append(f"{path}:{node.lineno}: uses private {node.value.id}.{node.attr}")
    return found


def _sources():
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield package, str(path.relative_to(ROOT)), path.read_text()
    yield "tests", "conftest.py", (ROOT / "conftest.py").read_text()


def test_every_folder_imports_only_downward():
    found = [v for package, path, source in _sources() for v in violations(package, path, source)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("package", "source", "what"),
    [
        ("model", "from goldens.store import load_golden", "not a layer below"),
        ("model", "def f():\n    import torch", "model/ imports torch"),
        ("parity", "import tests.compare", "not a layer below"),
        ("bench", "from tests.compare import assert_close", "not a layer below"),
        ("tests", "from parity.replay import _parser", "private parity.replay._parser"),
        ("tests", "from parity import run\nrun._step_fn", "private run._step_fn"),
    ],
    ids=["model->goldens", "model->torch", "parity->tests", "bench->tests", "private", "attr"],
)
def test_a_seeded_violation_is_named(package, source, what):
    found = violations(package, f"{package}/seeded.py", source)
    assert len(found) == 1 and what in found[0], found
