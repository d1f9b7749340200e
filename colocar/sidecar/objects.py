"""Remote objects living in the sidecar (`colocated_class` instances).

An object belongs to the session that created it and dies with it, or, when created with a
name, to the sidecar itself for a fixed lifetime: such a detached object outlives its session
(a checkpoint writer that must finish after the trainer died) and is found again by name.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import Any


class UnknownObjectError(KeyError):
    pass


@dataclass
class _Entry:
    value: Any
    session_id: str | None  # None: detached
    name: str
    expires_at: float  # detached objects only


class ObjectTable:
    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._entries: dict[int, _Entry] = {}
        self._names: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, value: Any, session_id: str, name: str = "", ttl_seconds: float = 0.0) -> int:
        with self._lock:
            object_id = next(self._ids)
            if name:
                if name in self._names:
                    raise ValueError(f"a detached object named {name!r} already exists here")
                expires = time.monotonic() + (ttl_seconds if ttl_seconds > 0 else 3600.0)
                self._entries[object_id] = _Entry(value, None, name, expires)
                self._names[name] = object_id
            else:
                self._entries[object_id] = _Entry(value, session_id, "", 0.0)
            return object_id

    def get(self, object_id: int, session_id: str) -> Any:
        entry = self._entries.get(object_id)
        if entry is None or entry.session_id not in (None, session_id):
            raise UnknownObjectError(
                f"remote object {object_id} does not exist here (deleted, its session expired, "
                "or the sidecar restarted)"
            )
        return entry.value

    def find(self, name: str) -> int:
        with self._lock:
            object_id = self._names.get(name)
        if object_id is None:
            raise UnknownObjectError(f"no detached object named {name!r} on this sidecar")
        return object_id

    def delete(self, object_id: int, session_id: str) -> bool:
        with self._lock:
            entry = self._entries.get(object_id)
            if entry is None or entry.session_id not in (None, session_id):
                return False
            del self._entries[object_id]
            if entry.name:
                self._names.pop(entry.name, None)
        return True

    def drop_session(self, session_id: str) -> int:
        with self._lock:
            ids = [i for i, e in self._entries.items() if e.session_id == session_id]
            for i in ids:
                del self._entries[i]
        return len(ids)

    def sweep(self) -> int:
        """Drops detached objects whose lifetime ended."""
        now = time.monotonic()
        with self._lock:
            ids = [i for i, e in self._entries.items() if e.session_id is None and e.expires_at < now]
            for i in ids:
                self._names.pop(self._entries.pop(i).name, None)
        return len(ids)

    def __len__(self) -> int:
        return len(self._entries)
