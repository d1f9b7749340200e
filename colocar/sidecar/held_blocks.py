"""The blocks of an ended session that its controller may still hold arrays over (sidecar).

A session's blocks are normally freed when it ends. But a controller on this host that maps
the arena may still hold arrays aliasing them (JAX on CPU aliases arena memory): the arrays a
program kept after `cluster.close()`, those of a controller whose lease lapsed while it lived
(the sidecar was stopped past it, a frozen VM), those of a named session that a new connection
of the same process took over (a notebook cell run again). Freeing them then would let later
results overwrite arrays already returned. So they stay while the controller's process still
maps the arena where that session's connection mapped it (read from `/proc/PID/maps`, which also
proves that process is the controller, whatever its PID namespace: at the address its
keepalives reported, else any mapping of the arena it has then), come back under the session
when it reconnects under the same id (a lapse), and are freed once that mapping is gone: the
last array over it died, or the process ended.
"""

from __future__ import annotations

import threading
from typing import Any


def arena_mappings(controller: str, path: str) -> set[int]:
    """Start addresses of the mappings of file `path` in the process `controller` ("host:pid")."""
    pid = controller.rpartition(":")[2]
    if not pid.isdigit() or not path:
        return set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            return {int(line.split("-", 1)[0], 16) for line in f if line.rstrip("\n").endswith(path)}
    except (OSError, ValueError):
        return set()


class HeldBlocks:
    """Decides, for each ended session, whether its blocks go now or wait for its controller."""

    def __init__(self, allocator: Any, arena_path: str):
        self._allocator = allocator
        self._path = arena_path
        self._held: dict[str, tuple[str, frozenset[int]]] = {}  # session id -> controller, mappings
        self._lock = threading.Lock()

    def session_ended(self, session_id: str, controller: str, mapping: int, comes_back: bool) -> None:
        """`mapping`: where the session's connection mapped the arena (0: unknown); `comes_back`:
        its controller may reconnect under the same id (a lapse), so the id may lease again."""
        found = arena_mappings(controller, self._path)
        watched = found & {mapping} if mapping else found
        if not comes_back:  # a result that finishes late holds nothing under this id
            self._allocator.end_owner(session_id, keep=bool(watched))
        if watched:
            with self._lock:
                self._held[session_id] = (controller, frozenset(watched))
        elif comes_back:
            self._allocator.release_owner(session_id)

    def reconnected(self, session_id: str) -> None:
        """The session is back: its blocks are its own again."""
        with self._lock:
            self._held.pop(session_id, None)

    def sweep(self) -> None:
        """Frees the held blocks whose controller no longer maps the arena where it did."""
        with self._lock:
            gone = [s for s, (c, m) in self._held.items() if not arena_mappings(c, self._path) & m]
            for session_id in gone:
                del self._held[session_id]
        for session_id in gone:
            self._allocator.release_owner(session_id)
