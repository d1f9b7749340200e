"""What a snapshot keeper holds of one snapshot, and the keys of its blocks (runs in the sidecar)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .peers import Target
from .stitch import Bounds

Key = tuple[int, Bounds]  # (leaf index, bounds)
ENDED = ("replicated", "failed")


def key_of(leaf: int, bounds: Any) -> Key:
    return int(leaf), tuple((int(a), int(b)) for a, b in bounds)


@dataclass
class Snap:
    step: int
    attempt: str  # a late call for an earlier attempt of the same step is refused
    peers: list[Target]
    own: dict[Key, np.ndarray] = field(default_factory=dict)
    replicas: dict[int, dict[Key, np.ndarray]] = field(default_factory=dict)  # source host -> blocks
    incoming: dict[tuple[int, Key], list[Any]] = field(default_factory=dict)  # -> [block, bytes so far]
    state: str = "copying"  # copying -> replicating -> replicated | failed
    error: str = ""
    record: bytes | None = None  # set by commit
    pending: bytes | None = None  # a record to commit once replicated (`MultiKeeper.commit_when_replicated`)
    replicated_bytes: int = 0
    replication_seconds: float = 0.0

    def blocks_from(self, source: int, host: int) -> dict[Key, np.ndarray]:
        """Where the blocks `source` sent go on keeper `host`: its own, or that peer's replicas."""
        return self.own if source == host else self.replicas.setdefault(source, {})

    def nbytes(self) -> int:
        blocks = list(self.own.values()) + [b for r in self.replicas.values() for b in r.values()]
        return sum(b.nbytes for b in blocks)
