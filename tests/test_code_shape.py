"""Small modules and short functions, in the package and in the tests.

Each module has one job and fits a few hundred lines; each function fits on a screen. The
generated protobuf modules are not counted. A module or function that outgrows its limit is
the sign that it took a second job: split it rather than raise the limit. A family of modules
sharing a name prefix in one folder (`snap_*.py`) is a subpackage waiting to be made.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
MAX_PREFIX_FAMILY = 2  # modules of one folder sharing a name prefix


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


def prefix_families(names: list[str], at_least: int = MAX_PREFIX_FAMILY + 1) -> dict[str, list[str]]:
    """Module names of one folder grouped by the part before their first `_`, the big groups."""
    groups: dict[str, list[str]] = {}
    for name in names:
        if "_" in name.strip("_"):
            groups.setdefault(name.lstrip("_").split("_")[0], []).append(name)
    return {prefix: sorted(found) for prefix, found in groups.items() if len(found) >= at_least}


def test_prefix_families_are_found():
    assert prefix_families(["snap_take", "snap_save", "snap_multi", "keeper", "__init__"]) == {
        "snap": ["snap_multi", "snap_save", "snap_take"]
    }


def test_no_prefix_family_in_one_flat_folder():
    """Three modules or more named `x_*` in one folder are a subpackage `x/` waiting to be made."""
    found = {}
    for folder in sorted({p.parent for p in _sources() if p.is_relative_to(REPO / "colocar")}):
        families = prefix_families([p.stem for p in folder.glob("*.py") if "_pb2" not in p.name])
        found.update({f"{folder.relative_to(REPO)}/{k}_*": v for k, v in families.items()})
    assert not found, f"prefix families (make them subpackages): {found}"
