"""Saves written from arrays already in the hosts' arenas, not from the devices (controller).

A `Held` source (a host-memory snapshot: `colocar.elastic.Snapshots.save_to`) plans the save
from what it holds and hands each host's writer views of the blocks that host holds; the
holder and the writer live in the same sidecar process, so nothing is copied and no arena
block is taken. `CheckpointManager.save_held` runs it like `save` (attempt, lease, fencing,
manifest, commit); a step saved this way restores with `restore` like any other.
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Any

from .inflight import Save
from .plan import Piece, Plan


class Held:
    """What a save from held blocks needs of their holder."""

    def plan(self, cluster: Any, chunk_bytes: int) -> tuple[Plan, Any]:
        """The manifest entries, the pieces per host index of `cluster` (each piece's `source`
        says which held block it is cut from) and the tree's skeleton."""
        raise NotImplementedError

    def hand_over(self, host: int, writer: Any, step: int, attempt: str, pieces: list[Piece]) -> int:
        """Host `host`'s pieces to its `writer` (all of them: the writer learns the total);
        returns the bytes handed over."""
        raise NotImplementedError


def send(record: Save, pieces: dict[int, list[Piece]], held: Held, senders: Executor) -> None:
    """Every host's pieces to its writer from the held blocks, one thread per host."""

    def one(h: int) -> int:
        if not pieces[h]:
            record.writers[h].finish(record.step, 0)
            return 0
        return held.hand_over(h, record.writers[h], record.step, record.attempt, pieces[h])

    for future in [senders.submit(one, h) for h in record.writers]:
        future.result()
    record.stats.pieces = sum(len(p) for p in pieces.values())
    record.stats.bytes = 0  # nothing was copied from the devices
