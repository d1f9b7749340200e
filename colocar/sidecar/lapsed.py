"""The blocks of a session whose lease lapsed while its controller still maps them (sidecar).

A lapsed session's blocks are normally freed at once. But a lease can lapse while the
controller lives: the sidecar was stopped past it (SIGSTOP, a frozen VM) or a link stalled.
A controller on this host that maps the arena may still hold arrays over those blocks, and it
reconnects under the same session id; freeing them then would let its next results overwrite
arrays it already returned. So the blocks stay while the controller's process still maps the
arena file (read from `/proc/PID/maps`, which also proves that process is the controller,
whatever its PID namespace), come back under the session when it reconnects (its views free
them one by one, as before), and are freed once it no longer maps the arena.
"""

from __future__ import annotations

import threading
from typing import Any


def maps_file(controller: str, path: str) -> bool:
    """Whether the process `controller` ("hostname:pid") maps the file `path`."""
    pid = controller.rpartition(":")[2]
    if not pid.isdigit() or not path:
        return False
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any(line.rstrip("\n").endswith(path) for line in f)
    except OSError:
        return False


class LapsedBlocks:
    """Decides, for each ended session, whether its blocks go now or wait for its controller."""

    def __init__(self, allocator: Any, arena_path: str):
        self._allocator = allocator
        self._path = arena_path
        self._held: dict[str, str] = {}  # session id -> controller, blocks kept
        self._lock = threading.Lock()

    def session_ended(self, session_id: str, controller: str, lapsed: bool) -> None:
        if lapsed and maps_file(controller, self._path):
            with self._lock:
                self._held[session_id] = controller
            return
        if lapsed:  # its controller may come back under the same id
            self._allocator.release_owner(session_id)
        else:  # closed: the id never comes back, so a result that finishes late holds nothing
            self._allocator.end_owner(session_id)

    def reconnected(self, session_id: str) -> None:
        """The session is back: its blocks are its own again."""
        with self._lock:
            self._held.pop(session_id, None)

    def sweep(self) -> None:
        """Frees the held blocks of controllers that no longer map the arena (ended)."""
        with self._lock:
            gone = [s for s, c in self._held.items() if not maps_file(c, self._path)]
            for session_id in gone:
                del self._held[session_id]
        for session_id in gone:
            self._allocator.release_owner(session_id)
