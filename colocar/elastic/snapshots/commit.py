"""The background half of a snapshot: hand-off, replication wait and commit (runs in the controller).

`take` copies the shards into arena blocks and returns; a background thread then takes the
snapshots in order (one replicates at a time) and for each hands every host its
blocks (`hand_off`: the keepers learn the step, drop what is not kept, take the blocks and
start replicating), and long-polls each host's keeper until its replication ended. When all
report `replicated`, the snapshot's record (pickled) is stored in every live keeper: from then
on it counts (`latest`), and a restarted controller finds it there. When one fails or its host
is lost, the snapshot never counts, unless every shard is complete on a live host (its own
copy or a replica that arrived: `_salvaged` commits it there); else its blocks are dropped on
the live hosts and a warning names the step and the cause.
"""

from __future__ import annotations

import logging
import pickle
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("colocar.elastic")
POLL_SECONDS = 1.0  # one status long-poll (a round of the wait)
HandOff = Callable[[], dict[int, dict[str, Any]]]  # -> the hosts' first statuses


@dataclass
class Tracked:
    step: int
    hosts: list[int]
    record: dict[str, Any]
    state: str = "replicating"  # -> committed | failed
    error: str = ""
    statuses: dict[int, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0
    hand_off: HandOff | None = None  # run first, then dropped (its blocks with it)
    then: Callable[[], None] | None = None  # run once committed (before `done`), then dropped
    handed: threading.Event = field(default_factory=threading.Event)  # the keepers hold the blocks
    done: threading.Event = field(default_factory=threading.Event)


class Committer:
    """Hands off, commits (or abandons) the snapshots `take` started, one at a time, in order,
    in one background thread."""

    def __init__(self, keeper: Callable[[int], Any], on_commit: Callable[[int], None], timeout: float):
        self._keeper = keeper  # host index -> keeper handle
        self._on_commit = on_commit
        self.timeout = timeout
        self.last: Tracked | None = None
        self._lock = threading.Lock()
        self._unhanded: dict[int, Tracked] = {}  # by step: tracked, its blocks not yet handed off
        self._queue: queue.SimpleQueue[Tracked | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def track(
        self,
        step: int,
        hosts: list[int],
        record: dict[str, Any],
        hand_off: HandOff | None = None,
        then: Callable[[], None] | None = None,
    ) -> Tracked:
        """Follows snapshot `step` once the snapshots tracked before it ended: `hand_off()`
        first, then the replication wait and the commit, then `then()` if it committed."""
        tracked = Tracked(step, hosts, record, hand_off=hand_off, then=then)
        with self._lock:
            self.last = tracked
            self._unhanded[step] = tracked
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="colocar-snap-commit", daemon=True)
                self._thread.start()
        self._queue.put(tracked)
        return tracked

    def wait(self, timeout: float | None = None) -> None:
        """Until the last snapshot is committed or abandoned; TimeoutError after `timeout` s."""
        last = self.last
        if last is not None and not last.done.wait(timeout):
            raise TimeoutError(f"replication of snapshot step {last.step} still runs after {timeout} s")

    def abandoned(self, step: int) -> bool:
        """Whether the last snapshot tracked is `step` and it was abandoned (its blocks dropped)."""
        last = self.last
        return last is not None and last.step == step and last.state == "failed"

    def wait_handed(self, step: int) -> None:
        """Until the keepers hold the blocks of snapshot `step`, or it ended."""
        tracked = self._unhanded.get(step)
        if tracked is not None:
            tracked.handed.wait()

    def close(self) -> None:
        """Ends the thread once what is tracked ended."""
        self._queue.put(None)

    def _work(self) -> None:
        while (tracked := self._queue.get()) is not None:
            self._run(tracked)

    def _run(self, tracked: Tracked) -> None:
        started = time.monotonic()
        try:
            if tracked.hand_off is not None:
                hand_off, tracked.hand_off = tracked.hand_off, None  # its blocks go with it
                tracked.statuses.update(hand_off())  # the keepers' first statuses
            self._handed(tracked)
            error = self._await_replicas(tracked, started + self.timeout)
            if error is None:
                self._commit(tracked)
                self._then(tracked)
            else:
                self._abandon(tracked, error)
        except Exception as e:  # noqa: BLE001 - a background thread: the error is recorded
            self._abandon(tracked, f"{type(e).__name__}: {e}")
        finally:
            tracked.then = None  # `last` outlives it
            tracked.seconds = time.monotonic() - started
            self._handed(tracked)
            tracked.done.set()

    def _then(self, tracked: Tracked) -> None:
        """`tracked.then()` once it committed; what it raises is logged (the snapshot counts)."""
        if tracked.state != "committed" or tracked.then is None:
            return
        try:
            tracked.then()
        except Exception as e:  # noqa: BLE001 - a background thread; the commit stands
            log.warning("after snapshot step %d committed: %s: %s", tracked.step, type(e).__name__, e)

    def _handed(self, tracked: Tracked) -> None:
        with self._lock:
            if self._unhanded.get(tracked.step) is tracked:
                del self._unhanded[tracked.step]
        tracked.handed.set()

    def _await_replicas(self, tracked: Tracked, deadline: float) -> str | None:
        """None once every host replicated its shards, else what went wrong. Each round
        long-polls every pending host at once for up to POLL_SECONDS (a lost or failed one
        ends the wait within a round; one that is done answers at once)."""
        for h, status in tracked.statuses.items():  # from the hand-off
            if (error := _failed(tracked, h, status)) is not None:
                return error
        pending = [h for h in tracked.hosts if tracked.statuses.get(h, {}).get("state") != "replicated"]
        attempt = tracked.record["attempt"]
        while pending:
            calls = {h: self._submit(h, "status", tracked.step, attempt, POLL_SECONDS) for h in pending}
            for h, call in calls.items():
                error = self._poll(tracked, h, call)
                if error is not None:
                    return error
            pending = [h for h in pending if tracked.statuses[h]["state"] != "replicated"]
            if pending and time.monotonic() > deadline:
                return f"hosts {pending}: replication did not finish within {self.timeout} s"
        return None

    def _poll(self, tracked: Tracked, h: int, call: Any) -> str | None:
        """Host `h`'s status of the snapshot from its `status` call in flight (recorded), or
        why it failed."""
        try:
            status = call.result()
        except Exception as e:
            return f"host {h}: {type(e).__name__}: {e}"
        tracked.statuses[h] = status
        return _failed(tracked, h, status)

    def _commit(self, tracked: Tracked) -> None:
        """The record goes to every host at once; it counts once one of them holds it."""
        if not self._store(tracked, tracked.hosts):
            self._abandon(tracked, "no host took the commit record")
            return
        tracked.state = "committed"
        self._on_commit(tracked.step)

    def _store(self, tracked: Tracked, hosts: list[int]) -> int:
        """The record stored in the keepers of `hosts`, all at once; how many took it."""
        record = pickle.dumps(tracked.record)
        calls = {h: self._submit(h, "commit", tracked.step, tracked.record["attempt"], record) for h in hosts}
        stored = 0
        for h, call in calls.items():
            try:
                call.result()
                stored += 1
            except Exception as e:  # a host lost now: the others hold the record
                log.warning(
                    "snapshot step %d: host %d did not take the commit record: %s", tracked.step, h, e
                )
        return stored

    def _submit(self, h: int, method: str, *args: Any) -> Any:
        """A call of host `h`'s keeper in flight (a future; failed at once when it cannot start)."""
        try:
            return getattr(self._keeper(h), method).submit(*args)
        except Exception as e:  # noqa: BLE001 - its result() raises it
            failed: Future[Any] = Future()
            failed.set_exception(e)
            return failed

    def _abandon(self, tracked: Tracked, error: str) -> None:
        if self._salvaged(tracked, error):
            return
        tracked.state, tracked.error = "failed", error
        log.warning(
            "snapshot of step %d is abandoned (the previous complete one stays): %s", tracked.step, error
        )
        for h in tracked.hosts:
            try:
                self._keeper(h).drop(tracked.step)
            except Exception:  # noqa: BLE001 - a lost host took its blocks with it
                pass

    def _salvaged(self, tracked: Tracked, error: str) -> bool:
        """Whether a snapshot whose replication a lost host cut short counts after all: when
        every shard is complete on a host that still answers (its own copy, or a replica that
        arrived), the record is stored on those hosts, so a loss right after a take costs the
        steps since that take, not since the one before (the snapshot's redundancy is what
        survived: the next take replicates in full again)."""
        from . import restore

        keepers = {}
        for h in tracked.hosts:
            try:
                keepers[h] = self._keeper(h)
            except Exception:  # noqa: BLE001 - a lost host: it holds nothing
                pass
        found = restore.survey(keepers, tracked.hosts)
        attempt = tracked.record["attempt"]
        holding = [h for h, held in found.items() if held.get(tracked.step, {}).get("attempt") == attempt]
        if len(holding) == len(tracked.hosts) or not holding:
            return False  # no host was lost (a failure of its own: a full pool, a timeout), or none is left
        if restore.missing(tracked.record, restore.holders(found, tracked.step, attempt)):
            return False
        if not self._store(tracked, holding):
            return False
        lost = sorted(set(tracked.hosts) - set(holding))
        log.warning(
            "snapshot of step %d counts without hosts %s (%s): every shard is on the others",
            tracked.step,
            lost,
            error,
        )
        tracked.state, tracked.error = "committed", f"salvaged without hosts {lost}: {error}"
        self._on_commit(tracked.step)
        return True


def _failed(tracked: Tracked, h: int, status: dict[str, Any]) -> str | None:
    """Why host `h`'s status says the snapshot failed there, or None."""
    if status["state"] in ("failed", "unknown"):
        return status["error"] or f"host {h}: step {tracked.step} {status['state']}"
    return None
