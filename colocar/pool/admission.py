"""The pool's admission queue: which tenants are served, and who waits for room, in what order.

Runs in the pool's agent. A tenant is served with its arena quota on every host; the pool has
`capacity` arena bytes per host and serves at most `max_tenants` at once. A tenant that does
not fit waits: higher priority first, then first come; only the head of the queue is admitted
(a large tenant is never overtaken forever by small ones). A served tenant's further jobs
come in at once (its own quotas bound them). The estimated wait is the mean time tenants
stayed served, spread over the tenants served now, times the position: an estimate, shown as
such; unknown until a tenant has left.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from colocar.errors import PoolFullError

from .tenants import Tenant


@dataclass(order=True)
class _Ticket:
    order: tuple[int, int]
    tenant: str = field(compare=False)
    arena: int = field(compare=False)
    since: float = field(compare=False, default_factory=time.monotonic)


class Admission:
    """Served tenants (name -> arena bytes per host, since when) and the queue."""

    def __init__(self, capacity: int, max_tenants: int):
        self.capacity, self.max_tenants = capacity, max_tenants
        self.served: dict[str, tuple[int, float]] = {}
        self._queue: list[_Ticket] = []
        self._arrivals = itertools.count()
        self._stays: deque[float] = deque(maxlen=20)  # how long the last tenants stayed served
        self.waits: deque[tuple[str, float]] = deque(maxlen=200)  # (tenant, seconds queued)
        self._changed = threading.Condition()

    def _fits(self, arena: int) -> bool:
        used = sum(a for a, _ in self.served.values())
        return len(self.served) < self.max_tenants and used + arena <= self.capacity

    def admit(
        self,
        tenant: Tenant,
        wait: bool,
        timeout: float,
        update: Callable[[int, float, int], None],
        gone: Callable[[], bool] = lambda: False,
    ) -> float | None:
        """Returns once `tenant` is served: the seconds it queued if it was admitted now (its
        sidecars are to start), None if it was served already. While it waits, `update(position, estimate,
        waiting)` runs whenever its position or the queue's length changes. PoolFullError without `wait`,
        after `timeout` seconds (0: none), or within 2 s of `gone()` (its caller left); the
        ticket then leaves the queue."""
        if tenant.arena > self.capacity:
            raise PoolFullError(
                f"tenant {tenant.name!r}: its arena quota ({tenant.arena} bytes) exceeds the pool's "
                f"capacity ({self.capacity} bytes per host): it can never be served"
            )
        with self._changed:
            if tenant.name in self.served:
                return None
            ticket = _Ticket((-tenant.priority, next(self._arrivals)), tenant.name, tenant.arena)
            self._queue.append(ticket)
            self._queue.sort()
            self._changed.notify_all()  # the tickets behind it moved back
            try:
                self._wait_turn(ticket, wait, timeout, update, gone)
            finally:
                self._queue.remove(ticket)
                self._changed.notify_all()
            if tenant.name in self.served:  # another job of the tenant got it in meanwhile
                return None
            self.served[tenant.name] = (tenant.arena, time.monotonic())
            self.waits.append((tenant.name, time.monotonic() - ticket.since))
            return self.waits[-1][1]

    def _wait_turn(
        self,
        ticket: _Ticket,
        wait: bool,
        timeout: float,
        update: Callable[[int, float, int], None],
        gone: Any,
    ) -> None:
        deadline = time.monotonic() + timeout if timeout > 0 else None
        said = None
        while (
            not (self._queue[0] is ticket and self._fits(ticket.arena)) and ticket.tenant not in self.served
        ):
            position = self._queue.index(ticket) + 1
            if not wait or (deadline is not None and time.monotonic() >= deadline):
                raise PoolFullError(self._full_message(ticket, position, wait))
            if gone():
                raise PoolFullError(f"tenant {ticket.tenant!r} left the queue (its caller went away)")
            if said != (position, len(self._queue)):
                said = (position, len(self._queue))
                self._changed.release()
                try:  # outside the lock: the update may block on the network
                    update(position, self.estimate(position), len(self._queue))
                finally:
                    self._changed.acquire()
            self._changed.wait(2.0 if deadline is None else max(0.01, min(2.0, deadline - time.monotonic())))

    def _full_message(self, ticket: _Ticket, position: int, waited: bool) -> str:
        used = sum(a for a, _ in self.served.values())
        why = f"waited {time.monotonic() - ticket.since:.0f} s (its timeout)" if waited else "not waiting"
        return (
            f"the pool is full for tenant {ticket.tenant!r}: {len(self.served)} of {self.max_tenants} "
            f"tenants served, {used} of {self.capacity} arena bytes per host in use, it needs "
            f"{ticket.arena}; queue position {position} of {len(self._queue)}; {why}"
        )

    def estimate(self, position: int) -> float:
        """Seconds until a ticket at `position` is likely served (-1: unknown)."""
        if not self._stays:
            return -1.0
        mean = sum(self._stays) / len(self._stays)
        return position * mean / max(1, len(self.served))

    def release(self, tenant: str) -> None:
        """The tenant's sidecars stopped: its room goes to the queue."""
        with self._changed:
            found = self.served.pop(tenant, None)
            if found is not None:
                self._stays.append(time.monotonic() - found[1])
            self._changed.notify_all()

    def queue(self) -> list[dict[str, object]]:
        with self._changed:
            return [
                {"tenant": t.tenant, "position": i + 1, "waiting_seconds": time.monotonic() - t.since}
                for i, t in enumerate(self._queue)
            ]
