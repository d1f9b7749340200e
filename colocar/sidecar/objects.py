"""Remote objects living in the sidecar (`colocated_class` instances).

An object belongs to the session that created it and dies with it. One created with a name is
found again by name: in a named session (`connect(..., session="exp1")`) it stays the session's
(the name is the session's own, and the object passes to the controller that takes the session
over, see `sessions`); otherwise, or with a `ttl`, it is *detached*: it belongs to the sidecar
for that lifetime and outlives its session (a checkpoint writer that must finish after the
trainer died). A name is looked up in the caller's session first, then among detached ones.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import Any

DETACHED_TTL = 3600.0  # seconds a detached object lives when no ttl is given


class UnknownObjectError(KeyError):
    pass


@dataclass
class _Entry:
    value: Any
    session_id: str | None  # None: detached
    name: str
    expires_at: float  # detached objects only
    scope: str = ""  # the session name a named object belongs to ("": detached)


class ObjectTable:
    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._entries: dict[int, _Entry] = {}
        self._names: dict[tuple[str, str], int] = {}  # (scope, name) -> id
        self._lock = threading.Lock()

    def add(
        self, value: Any, session_id: str, name: str = "", ttl_seconds: float = 0.0, scope: str = ""
    ) -> int:
        """A new object of `session_id`; with a `name`, the session's own when it is a named
        session (`scope`) and no ttl is given, else detached for `ttl_seconds`."""
        with self._lock:
            object_id = next(self._ids)
            if not name:
                self._entries[object_id] = _Entry(value, session_id, "", 0.0)
                return object_id
            scope = scope if ttl_seconds <= 0 else ""
            if (scope, name) in self._names:
                where = f"in session {scope!r}" if scope else "detached"
                raise ValueError(f"an object named {name!r} already exists here ({where})")
            if scope:
                self._entries[object_id] = _Entry(value, session_id, name, 0.0, scope)
            else:
                expires = time.monotonic() + (ttl_seconds if ttl_seconds > 0 else DETACHED_TTL)
                self._entries[object_id] = _Entry(value, None, name, expires)
            self._names[(scope, name)] = object_id
            return object_id

    def get(self, object_id: int, session_id: str) -> Any:
        entry = self._entries.get(object_id)
        if entry is None or entry.session_id not in (None, session_id):
            raise UnknownObjectError(
                f"remote object {object_id} does not exist here (deleted, its session expired, "
                "or the sidecar restarted)"
            )
        return entry.value

    def find(self, name: str, scope: str = "") -> int:
        """The object named `name` in the session `scope`, else the detached one."""
        with self._lock:
            object_id = self._names.get((scope, name)) if scope else None
            if object_id is None:
                object_id = self._names.get(("", name))
        if object_id is None:
            where = f"in session {scope!r} or detached" if scope else "detached"
            raise UnknownObjectError(f"no object named {name!r} on this sidecar ({where})")
        return object_id

    def delete(self, object_id: int, session_id: str) -> bool:
        with self._lock:
            entry = self._entries.get(object_id)
            if entry is None or entry.session_id not in (None, session_id):
                return False
            self._remove(object_id)
        return True

    def _remove(self, object_id: int) -> None:
        entry = self._entries.pop(object_id)
        if entry.name:
            self._names.pop((entry.scope, entry.name), None)

    def drop_session(self, session_id: str) -> int:
        with self._lock:
            ids = [i for i, e in self._entries.items() if e.session_id == session_id]
            for i in ids:
                self._remove(i)
        return len(ids)

    def move_named(self, from_session: str, to_session: str) -> list[str]:
        """Gives a session's named objects to the session that took it over; their names."""
        with self._lock:
            moved = [e for e in self._entries.values() if e.session_id == from_session and e.name]
            for entry in moved:
                entry.session_id = to_session
        return sorted(e.name for e in moved)

    def count(self, session_id: str) -> int:
        """Objects of the session (detached ones belong to no session)."""
        with self._lock:
            return sum(e.session_id == session_id for e in self._entries.values())

    def sweep(self) -> int:
        """Drops detached objects whose lifetime ended."""
        now = time.monotonic()
        with self._lock:
            ids = [i for i, e in self._entries.items() if e.session_id is None and e.expires_at < now]
            for i in ids:
                self._remove(i)
        return len(ids)

    def __len__(self) -> int:
        return len(self._entries)
