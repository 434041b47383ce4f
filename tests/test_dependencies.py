"""Every third-party package that stepcredit imports is declared in pyproject.toml.

Imports are read with `ast` from every .py file under stepcredit/, at module level
and inside functions (lazy imports) alike. Each top-level module that is not in the
standard library must belong to a distribution named in `dependencies` or in one of
the `optional-dependencies` extras.
"""

import ast
import importlib.metadata
import pathlib
import re
import sys

try:
    import tomllib
except ImportError:  # Python 3.10
    import pytest

    tomllib = pytest.importorskip("tomli")

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "stepcredit"


def _normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> set[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    return {_normalize(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", r).group(1)) for r in requirements}


def _imported_modules(source: str) -> set[str]:
    """Top-level names of the absolute imports anywhere in `source`."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _undeclared(sources: dict[str, str]) -> dict[str, list[str]]:
    """Third-party modules imported by `sources` (name -> text) that no declared
    distribution provides, each with the files that import it."""
    declared = _declared()
    distributions = importlib.metadata.packages_distributions()
    missing: dict[str, list[str]] = {}
    for name, source in sorted(sources.items()):
        for module in sorted(_imported_modules(source)):
            if module in sys.stdlib_module_names or module in ("__future__", "stepcredit"):
                continue
            # An uninstalled module is checked under its own name (textworld, torch, ...).
            providers = {_normalize(d) for d in distributions.get(module, [module])}
            if not providers & declared:
                missing.setdefault(module, []).append(name)
    return missing


def test_every_stepcredit_import_is_declared():
    sources = {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in PACKAGE.rglob("*.py")}
    assert len(sources) > 10
    missing = _undeclared(sources)
    assert not missing, (
        "imported by stepcredit but not declared in pyproject.toml's dependencies or "
        f"optional-dependencies: {missing}")


def test_an_undeclared_import_is_caught():
    source = "import jax\nfrom torch import nn\n\ndef f():\n    import filelock\n    import not_a_real_module_xyz\n"
    assert set(_undeclared({"example.py": source})) == {"filelock", "not_a_real_module_xyz"}
