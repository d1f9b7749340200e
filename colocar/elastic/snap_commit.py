"""The commit of a snapshot once every shard and its replicas are in place (runs in the controller).

After `take` handed every host its blocks, a background thread long-polls each host's keeper
until its replication ended. When all report `replicated`, the snapshot's record (pickled) is
stored in every live keeper: from then on it counts (`latest`), and a restarted controller
finds it there. When one fails or its host is lost, the snapshot never counts: its blocks are
dropped on the live hosts and a warning names the step and the cause.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("colocar.elastic")
POLL_SECONDS = 1.0  # one status long-poll (a round of the wait)


@dataclass
class Tracked:
    step: int
    hosts: list[int]
    record: dict[str, Any]
    state: str = "replicating"  # -> committed | failed
    error: str = ""
    statuses: dict[int, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


class Committer:
    """Commits (or abandons) the snapshots `take` started, one at a time."""

    def __init__(self, keeper: Callable[[int], Any], on_commit: Callable[[int], None], timeout: float):
        self._keeper = keeper  # host index -> keeper handle
        self._on_commit = on_commit
        self.timeout = timeout
        self.last: Tracked | None = None
        self._lock = threading.Lock()

    def track(self, step: int, hosts: list[int], record: dict[str, Any]) -> Tracked:
        tracked = Tracked(step, hosts, record)
        with self._lock:
            self.last = tracked
        threading.Thread(
            target=self._run, args=(tracked,), name=f"colocar-snap-commit-{step}", daemon=True
        ).start()
        return tracked

    def wait(self, timeout: float | None = None) -> None:
        """Until the last snapshot is committed or abandoned; TimeoutError after `timeout` s."""
        last = self.last
        if last is not None and not last.done.wait(timeout):
            raise TimeoutError(f"replication of snapshot step {last.step} still runs after {timeout} s")

    def _run(self, tracked: Tracked) -> None:
        started = time.monotonic()
        try:
            error = self._await_replicas(tracked, started + self.timeout)
            if error is None:
                self._commit(tracked)
            else:
                self._abandon(tracked, error)
        except Exception as e:  # noqa: BLE001 - a background thread: the error is recorded
            self._abandon(tracked, f"{type(e).__name__}: {e}")
        finally:
            tracked.seconds = time.monotonic() - started
            tracked.done.set()

    def _await_replicas(self, tracked: Tracked, deadline: float) -> str | None:
        """None once every host replicated its shards, else what went wrong. Each round asks
        every pending host at once (a lost or failed one ends the wait within a round), then
        long-polls the first for up to POLL_SECONDS."""
        pending = list(tracked.hosts)
        while pending:
            for i, h in enumerate(pending):
                error = self._poll(tracked, h, POLL_SECONDS if i == 0 else 0.0)
                if error is not None:
                    return error
            pending = [h for h in pending if tracked.statuses[h]["state"] != "replicated"]
            if pending and time.monotonic() > deadline:
                return f"hosts {pending}: replication did not finish within {self.timeout} s"
        return None

    def _poll(self, tracked: Tracked, h: int, timeout: float) -> str | None:
        """Host `h`'s status of the snapshot (recorded), or why it failed."""
        try:
            status = self._keeper(h).status(tracked.step, tracked.record["attempt"], timeout)
        except Exception as e:
            return f"host {h}: {type(e).__name__}: {e}"
        tracked.statuses[h] = status
        if status["state"] in ("failed", "unknown"):
            return status["error"] or f"host {h}: step {tracked.step} {status['state']}"
        return None

    def _commit(self, tracked: Tracked) -> None:
        record = pickle.dumps(tracked.record)
        stored = 0
        for h in tracked.hosts:
            try:
                self._keeper(h).commit(tracked.step, tracked.record["attempt"], record)
                stored += 1
            except Exception as e:  # a host lost now: the others hold the record
                log.warning(
                    "snapshot step %d: host %d did not take the commit record: %s", tracked.step, h, e
                )
        if not stored:
            self._abandon(tracked, "no host took the commit record")
            return
        tracked.state = "committed"
        self._on_commit(tracked.step)

    def _abandon(self, tracked: Tracked, error: str) -> None:
        tracked.state, tracked.error = "failed", error
        log.warning(
            "snapshot of step %d is abandoned (the previous complete one stays): %s", tracked.step, error
        )
        for h in tracked.hosts:
            try:
                self._keeper(h).drop(tracked.step)
            except Exception:  # noqa: BLE001 - a lost host took its blocks with it
                pass
