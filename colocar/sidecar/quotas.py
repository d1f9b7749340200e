"""A tenant's limits in its own sidecar: sessions and concurrent calls, refused with a clear error.

Runs in the sidecar. A shared pool (`colocar.pool`) starts one sidecar per tenant per host,
with `--tenant` and these limits; the tenant's two other quotas are bounded by the process
itself: arena bytes (`--arena-size`) and worker processes (`--processes`). A refusal is
RESOURCE_EXHAUSTED naming the tenant, the quota and the current use (the controller raises
`QuotaExceededError`); each is counted for the pool's metrics. Without `--tenant` only
`--threads` bounds concurrent calls, and they wait for a slot instead of being refused.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import threading
from dataclasses import dataclass, field

from colocar.protocol.status import ARENA_QUOTA_REACHED, QUOTA_REACHED, Refused, Status


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tenant", default="", help="the tenant this sidecar serves (in a shared pool)")
    p.add_argument(
        "--max-sessions", type=int, default=0, help="the tenant's sessions quota (0: no limit)"
    )
    p.add_argument(
        "--max-calls",
        type=int,
        default=0,
        help="the tenant's concurrent calls and streams quota: more are refused, not queued (0: no limit)",
    )


@dataclass
class Quotas:
    """The limits of the tenant a sidecar serves (0: none) and how often each refused."""

    tenant: str = ""
    sessions: int = 0
    calls: int = 0
    refusals: collections.Counter[str] = field(default_factory=collections.Counter)
    _running: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Quotas:
        return cls(args.tenant, max(0, args.max_sessions), max(0, args.max_calls))

    def _refuse(self, quota: str, limit: int, used: str) -> None:
        self.refusals[quota] += 1
        who = f"tenant {self.tenant!r}" if self.tenant else "this sidecar"
        raise Refused(Status.RESOURCE_EXHAUSTED, f"{who}: {quota} {QUOTA_REACHED} ({limit}; in use: {used})")

    def check_new_session(self, open_sessions: list[str]) -> None:
        """Refuses one more session when `open_sessions` (names or id prefixes) fill the quota."""
        if self.sessions and len(open_sessions) >= self.sessions:
            self._refuse("sessions", self.sessions, f"{len(open_sessions)}: {', '.join(open_sessions)}")

    def call(self) -> contextlib.AbstractContextManager[None]:
        """One running call or stream (`with`), refused when the quota's calls already run."""
        return self if self.calls else _UNLIMITED

    def __enter__(self) -> None:
        with self._lock:
            running, admitted = self._running, self._running < self.calls
            self._running += admitted
        if not admitted:
            self._refuse("concurrent calls", self.calls, f"{running} running")

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._running -= 1

    def arena_full(self, size: int, message: str) -> Refused:
        """A full arena, said as the tenant's arena quota when this sidecar serves one."""
        if not self.tenant:
            return Refused(Status.RESOURCE_EXHAUSTED, message)
        self.refusals["arena"] += 1
        return Refused(
            Status.RESOURCE_EXHAUSTED,
            f"tenant {self.tenant!r}: {ARENA_QUOTA_REACHED} ({size} bytes; {message})",
        )


_UNLIMITED = contextlib.nullcontext()
