"""Fencing the writers of a checkpoint directory's earlier lease holders (runs in the sidecar).

A save's writers live in the sidecars and outlive their trainer (so that a step the trainer
started still commits). When another manager takes the directory's lease over, writers of the
earlier holders may still be running. The new holder calls `fence_writers` on each of its hosts
before it saves: every writer of the directory that belongs to another manager stops its jobs
and never commits again. A writer on a host the new holder does not reach is stopped by
`check_lease` instead: its commit marker is written only while its manager holds the lease.
Either way an old writer can only complete its own attempt (see `layout`), never the new
holder's.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from ..format import layout
from ..store.storage import Storage

_WRITERS: weakref.WeakSet[Any] = weakref.WeakSet()  # every CheckpointWriter of this process
_LOCK = threading.Lock()


def register(writer: Any) -> None:
    with _LOCK:
        _WRITERS.add(writer)


def fence_writers(url: str, owner: str, everyone: bool = True) -> int:
    """Fences the writers of `url` in this sidecar made by managers other than `owner` (the new
    lease holder); returns how many jobs in progress it stopped. Without `everyone` (processes
    of one job share the sidecar), only the writers of managers that held the lease (one of
    their writers was given a step to commit): their siblings' writers commit nothing."""
    with _LOCK:
        others = [w for w in _WRITERS if w.url == url and w.options.owner != owner]
    holders = {w.options.owner for w in others if everyone or w.commits}
    reason = f"another CheckpointManager ({owner}) took over the lease of {url}; this save is abandoned"
    return sum(w.fence(reason) for w in others if w.options.owner in holders)


def check_lease(storage: Storage, owner: str) -> None:
    """Raises when the lease of `storage` is held by a manager other than `owner` (no lease, or
    a writer made without an owner: nothing to check)."""
    if not owner:
        return
    holder = layout.holder_of(storage)
    if holder.get("owner") not in (None, owner):
        raise RuntimeError(
            f"another CheckpointManager (pid {holder.get('pid')} on {holder.get('hostname')}) holds the "
            f"lease of {storage.url} now; this save is abandoned"
        )
