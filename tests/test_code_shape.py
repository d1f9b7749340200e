"""Small modules and short functions, in the package and in the tests.

Each module has one job and fits a few hundred lines; each function fits on a screen. The
generated protobuf modules are not counted. A module or function that outgrows its limit is
the sign that it took a second job: split it rather than raise the limit.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def _sources() -> list[Path]:
    paths = sorted((REPO / "colocar").rglob("*.py")) + sorted((REPO / "tests").rglob("*.py"))
    return [p for p in paths if "_pb2" not in p.name]


def test_the_sources_are_found():
    names = {p.name for p in _sources()}
    assert {"connection.py", "session.py", "test_code_shape.py"} <= names


def test_no_module_over_the_limit():
    long = [
        f"{p.relative_to(REPO)} ({n})"
        for p in _sources()
        if (n := p.read_text().count("\n")) > MAX_MODULE_LINES
    ]
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them): {', '.join(long)}"


def test_no_function_over_the_limit():
    long = [
        f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
        for path in _sources()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them): {', '.join(long)}"
