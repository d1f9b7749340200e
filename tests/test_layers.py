"""Imports between colocar's packages point down the layers docs/architecture.md orders them in.

`LAYERS` is that order, bottom up, written as data; docs/architecture.md states the same list
("Layers, bottom up: ..."), and a test checks the two agree. A module may import modules of
its own package and of packages on LOWER layers only: not upward, and not sideways into
another package of its own layer (`sidecar` and `controller_bridge` run in different
processes; `loaders` and `checkpoint` do not know each other). The graph is test_import_graph's:
every import, inside functions too, except under `if TYPE_CHECKING:`.

An import that breaks the order is named in `ALLOWED`, module to module, with the reason it is
there; any other fails the test, and an allowed one that is gone must leave the list.
"""

from __future__ import annotations

import re
from pathlib import Path

from test_import_graph import import_graph

REPO = Path(__file__).resolve().parent.parent

# Bottom up. A package is `colocar.NAME` (`colocar` alone: the public API, colocar/__init__.py).
LAYERS: list[tuple[str, ...]] = [
    ("shm", "jax_compat", "errors", "sizes", "cli_help", "pids"),  # depend on nothing of ours
    ("protocol",),
    ("sidecar", "controller_bridge"),
    ("loaders", "checkpoint"),
    ("elastic",),
    ("colocar", "pool"),  # the public API (it reaches elastic lazily); the shared pool
    ("demo", "k8s", "slurm"),
    ("bench",),
    ("cli",),
    ("__main__",),  # python -m colocar
]

ALLOWED: dict[tuple[str, str], str] = {}  # (module, module it imports) -> why, for an upward edge


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "colocar"


def layer_index(layers: list[tuple[str, ...]]) -> dict[str, int]:
    return {package: i for i, layer in enumerate(layers) for package in layer}


def breaking_edges(
    graph: dict[str, set[str]], layers: list[tuple[str, ...]]
) -> list[tuple[str, str, str, str]]:
    """(importer, imported, its package's layer, the imported's) for every import between two
    packages that does not point to a lower layer."""
    index = layer_index(layers)
    found = []
    for module, imported in sorted(graph.items()):
        for target in sorted(imported):
            a, b = package_of(module), package_of(target)
            if a != b and index[b] >= index[a]:
                found.append((module, target, f"{a} ({index[a]})", f"{b} ({index[b]})"))
    return found


def test_every_package_has_one_layer() -> None:
    packages = {package_of(m) for m in import_graph()}
    listed = [p for layer in LAYERS for p in layer]
    assert len(listed) == len(set(listed)), "a package on two layers"
    assert packages - set(listed) == set(), "packages without a layer: add them to LAYERS and docs"
    assert set(listed) - packages == set(), "LAYERS names packages that no longer exist"


def test_no_import_points_up_or_sideways() -> None:
    found = [e for e in breaking_edges(import_graph(), LAYERS) if (e[0], e[1]) not in ALLOWED]
    assert not found, (
        "imports against the layers (bottom up: "
        + " < ".join("/".join(layer) for layer in LAYERS)
        + "):\n"
        + "\n".join(f"{a} -> {b}: {la} imports {lb}" for a, b, la, lb in found)
    )


def test_every_allowed_edge_still_exists() -> None:
    graph = import_graph()
    gone = [edge for edge in ALLOWED if edge[1] not in graph.get(edge[0], set())]
    assert not gone, f"allowed imports no longer made (take them out of ALLOWED): {gone}"
    breaking = {(a, b) for a, b, _, _ in breaking_edges(graph, LAYERS)}
    assert set(ALLOWED) <= breaking, "ALLOWED lists imports that keep the order"


def test_an_upward_or_sideways_import_is_reported() -> None:
    """The check itself: fabricated imports against the order are found, the others are not."""
    graph = {
        "colocar.shm.arena": {"colocar.protocol.payload"},  # up: shm imports protocol
        "colocar.sidecar.blocks": {"colocar.shm", "colocar.controller_bridge.cluster"},  # sideways
        "colocar.loaders.feed": {"colocar.loaders.ring", "colocar.controller_bridge.cluster"},  # fine
        "colocar.protocol.payload": {"colocar.shm"},
        "colocar.controller_bridge.cluster": set(),
        "colocar.shm": set(),
        "colocar.loaders.ring": set(),
    }
    found = breaking_edges(graph, LAYERS)
    assert [(a, b) for a, b, _, _ in found] == [
        ("colocar.shm.arena", "colocar.protocol.payload"),
        ("colocar.sidecar.blocks", "colocar.controller_bridge.cluster"),
    ]
    assert found[0][2:] == ("shm (0)", "protocol (1)")


def _documented_layers() -> list[tuple[str, ...]]:
    """The order as docs/ states it: "Layers, bottom up: `a`, `b`; `c`; ... ." (one paragraph)."""
    for path in sorted((REPO / "docs").rglob("*.md")):
        for paragraph in path.read_text().split("\n\n"):
            text = " ".join(paragraph.split())
            if "Layers, bottom up:" in text:
                listed = re.split(r"\.(?:\s|$)", text.split("Layers, bottom up:", 1)[1], maxsplit=1)[0]
                return [tuple(re.findall(r"`(\w+)`", part)) for part in listed.split(";")]
    raise AssertionError('no "Layers, bottom up:" sentence in docs/')


def test_the_docs_state_the_same_layers() -> None:
    assert _documented_layers() == LAYERS
