"""The `colocar` package has no import cycle, counting imports inside functions too.

The graph is read from the source with `ast` (nothing is imported): an edge for every
`import` and `from ... import` of a colocar module, wherever it stands, except inside
`if TYPE_CHECKING:` blocks (never run). `from pkg import name` points at the submodule
`pkg.name` when there is one, else at `pkg` itself. A package's parents, which Python runs
first, are not edges: they would make every module depend on `colocar/__init__.py`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import colocar

ROOT = Path(colocar.__file__).parent


def module_names() -> dict[str, Path]:
    """Every module of the package by dotted name (a package is its `__init__.py`)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
    return name == "TYPE_CHECKING"


def _imports(tree: ast.AST) -> list[tuple[str, int, tuple[str, ...]]]:
    """(module or "", level, names) of every import statement outside `if TYPE_CHECKING:`."""
    found = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.extend((alias.name, 0, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.append((node.module or "", node.level, tuple(a.name for a in node.names)))
        stack.extend(ast.iter_child_nodes(node))
    return found


def edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The colocar modules that module `name` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for module, level, names in _imports(ast.parse(path.read_text(), str(path))):
        if level:
            base = package.split(".")[: len(package.split(".")) - (level - 1)]
            module = ".".join(base + ([module] if module else []))
        if module.split(".")[0] != "colocar":
            continue
        targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules]
        if len(targets) < len(names) or not names:
            targets.append(module)
        out.update(t for t in targets if t in modules and t != name)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: edges(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(set(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, component) for component in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle in component {sorted(component)}")


def test_the_graph_sees_imports_inside_functions_and_skips_type_checking(tmp_path):
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from .b import B\n"
        "def f():\n    from . import c\n    import colocar.d\n"
    )
    path = tmp_path / "a.py"
    path.write_text(source)
    modules = {n: path for n in ("colocar.x.a", "colocar.x.b", "colocar.x.c", "colocar.d")}
    assert edges("colocar.x.a", path, modules) == {"colocar.x.c", "colocar.d"}


def test_cycles_are_found_and_named():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "colocar.controller_bridge.func" in graph
    found = cycles(graph)
    assert not found, "import cycles in colocar:\n" + "\n".join(" -> ".join(c) for c in found)
