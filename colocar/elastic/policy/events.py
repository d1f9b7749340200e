"""What the elastic manager did, with timings: logged, counted and kept for `stats()`.

Runs in the controller. Every snapshot, save, restore, fallback (the newest snapshot unusable),
fault, loss, recovery and scale-up is an event: a kind, the step, the seconds it took, the hosts
involved and a short detail. Each is logged on the "colocar.elastic" logger as it happens (a
loss, fault or fallback as a warning); `stats()` gives them back with counts and totals per kind.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger("colocar.elastic")

KINDS = ("snapshot", "replication", "save", "restore", "fallback", "fault", "loss", "recovery", "scale_up")


@dataclass
class Event:
    kind: str
    step: int | None
    seconds: float = 0.0
    hosts: list[str] = field(default_factory=list)
    detail: str = ""
    time: float = field(default_factory=time.time)


class Events:
    """The event log of one manager (thread-safe; keeps the last `keep` events)."""

    def __init__(self, keep: int = 1000):
        self._events: list[Event] = []
        self._counts: dict[str, int] = dict.fromkeys(KINDS, 0)
        self._seconds: dict[str, float] = dict.fromkeys(KINDS, 0.0)
        self._keep = keep
        self._lock = threading.Lock()

    def add(
        self,
        kind: str,
        step: int | None,
        seconds: float = 0.0,
        hosts: list[str] | None = None,
        detail: str = "",
    ) -> Event:
        event = Event(kind, step, seconds, list(hosts or []), detail)
        with self._lock:
            self._events.append(event)
            del self._events[: -self._keep]
            self._counts[kind] = self._counts.get(kind, 0) + 1
            self._seconds[kind] = self._seconds.get(kind, 0.0) + seconds
        level = logging.WARNING if kind in ("loss", "fault", "fallback") else logging.INFO
        where = f" hosts {','.join(event.hosts)}" if event.hosts else ""
        log.log(
            level,
            "elastic %s at step %s in %.3f s%s%s",
            kind,
            step,
            seconds,
            where,
            f": {detail}" if detail else "",
        )
        return event

    def last(self, kind: str) -> Event | None:
        with self._lock:
            return next((e for e in reversed(self._events) if e.kind == kind), None)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "counts": dict(self._counts),
                "seconds": dict(self._seconds),
                "events": [asdict(e) for e in self._events],
            }
