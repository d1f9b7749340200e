"""Which held shards cover a restored slice (pure functions, shared by the restores).

A snapshot's shards of one leaf are either the same slice or disjoint (they come from a
sharding). A target device's slice is covered by one holder of every shard it overlaps when
there is one, else by each overlapping shard's part from one of its holders (`sources`);
`check_covered` refuses a slice the parts do not fill. Used by the single-controller restore
(`snapshots/restore.py`) over hosts, and by the multi-controller one (`snapshots/multi/restore.py`) over
JAX processes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from colocar.errors import SnapshotError

from .keepers.held import Key
from .keepers.stitch import Bounds


def overlap(a: Bounds, b: Bounds) -> Bounds | None:
    """The common part of two slices, or None."""
    lo_hi = tuple((max(x, z), min(y, w)) for (x, y), (z, w) in zip(a, b, strict=True))
    return None if any(hi <= lo for lo, hi in lo_hi) else lo_hi


def sources(
    h: int, leaf: int, bounds: Bounds, where: dict[Key, list[int]], load: dict[int, int]
) -> list[tuple[int, Bounds]]:
    """(holder, part) covering one slice: all from one holder when possible, else each
    intersecting shard from one of its holders; `h` (the device's own) first, else the holder
    serving the fewest elements so far (`load`, updated)."""
    parts = [(key, part) for key in where if key[0] == leaf and (part := overlap(key[1], bounds)) is not None]
    common = set.intersection(*[set(where[k]) for k, _ in parts]) if parts else set()
    chosen = [(common, bounds)] if common else [(set(where[k]), part) for k, part in parts]
    out = []
    for holders, part in chosen:
        source = h if h in holders else min(holders, key=lambda x: (load.get(x, 0), x))
        load[source] = load.get(source, 0) + volume(part)
        out.append((source, part))
    return out


def volume(bounds: Any) -> int:
    return int(np.prod([b - a for a, b in bounds], dtype=np.int64))


def check_covered(step: int, leaf: int, bounds: Any, parts: list[Bounds]) -> None:
    """The parts (disjoint: distinct shards) fill the slice, or SnapshotError: never a slice
    with a hole in it."""
    want = volume(bounds)
    got = sum(volume(part) for part in parts)
    if got != want:
        raise SnapshotError(
            f"snapshot step {step}: the held shards of leaf {leaf} cover {got} of the {want} "
            f"elements of slice {bounds}"
        )
