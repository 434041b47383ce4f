"""The layers point one way, and no module imports itself back through another.

Imports are read from the source (`ast`), including those inside functions,
except under `if TYPE_CHECKING:`, which never run.
"""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "stepcredit"

# Each layer may import only itself and the layers listed (the package root
# `stepcredit` re-exports for users and is imported by none of them).
ALLOWED = {
    "stepcredit.advantages": set(),
    "stepcredit.losses": {"stepcredit.advantages"},
    "stepcredit.envs": {"stepcredit.keys"},
    "stepcredit.models": {"stepcredit.prompts", "stepcredit.keys"},
    "stepcredit.keys": set(),
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: pathlib.Path, modules) -> set[str]:
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node):
            if "TYPE_CHECKING" in ast.unparse(node.test):
                for child in node.orelse:
                    self.visit(child)
            else:
                self.generic_visit(node)

        def visit_Import(self, node):
            found.update(alias.name for alias in node.names)

        def visit_ImportFrom(self, node):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in modules else base)

    Visitor().visit(ast.parse(path.read_text(encoding="utf-8")))
    return {m for m in found if m in modules and m != name}


def _graph():
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_no_import_cycle():
    graph, state, cycles = _graph(), {}, []
    assert {"stepcredit.train.build", "stepcredit.train.learn"} <= graph["stepcredit.train.trainer"]
    assert "stepcredit.train.trainer" not in graph["stepcredit.train.evaluate"]

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for child in sorted(graph[node]):
            if state.get(child) == "open":
                cycles.append(stack[stack.index(child):] + [child])
            elif child not in state:
                visit(child, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_lower_layers_import_no_higher_one():
    def layer(module):
        return next((l for l in ALLOWED if module == l or module.startswith(l + ".")), None)

    wrong = [(module, imported) for module, imports in _graph().items()
             if layer(module) is not None
             for imported in imports
             if layer(imported) != layer(module) and layer(imported) not in ALLOWED[layer(module)]]
    assert not wrong, f"imports against the layer order: {wrong}"
