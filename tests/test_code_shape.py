"""The package's shape, checked on its source: small functions, no import cycles, and the layers
in order -- ``parallel/`` (mesh axes, layouts, collectives) below ``modules/`` (the layers that
compute with them), never the other way round."""

import ast
import os
from typing import Dict, List, Set

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "titanax")
# The longest function the package may hold (its docstring included).
MAX_FUNCTION_LINES = 60


def _modules() -> Dict[str, str]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = "titanax" + path[len(PACKAGE):-3].replace(os.sep, ".")
                out[dotted[:-len(".__init__")] if dotted.endswith(".__init__") else dotted] = path
    return out


def _imports(name: str, path: str, modules: Dict[str, str]) -> Set[str]:
    """The package's modules ``name`` imports anywhere in its file (deferred imports too: a cycle
    hidden in a function is still a cycle)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                member = f"{base}.{alias.name}"
                found.add(member if member in modules else base)
    return {m for m in found if m in modules and m != name}


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    components = []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_no_function_is_longer_than_60_lines():
    long = []
    for name, path in _modules().items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        long += [f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
                 for node in ast.walk(tree)
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long


def test_no_import_cycles_and_parallel_imports_no_module():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert not _cycles(graph), _cycles(graph)
    upward = sorted((name, other) for name, imported in graph.items()
                    if name.startswith("titanax.parallel") for other in imported
                    if other.startswith("titanax.modules"))
    assert not upward, upward


def test_the_checks_see_what_they_check():
    """The scanners find what they look for: a known long-enough function and known imports."""
    modules = _modules()
    assert len(modules) > 100
    assert "titanax.parallel.axis_binding" in _imports(
        "titanax.modules.context", modules["titanax.modules.context"], modules)
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
