"""The saves a manager started that have not ended yet, followed until they do (controller).

`InFlight` asks this process's writers how each save is going: `wait_hosts` sends one
long-poll per host whose part has not ended (in parallel), which the writer answers as soon as
its job ended, so a save costs one `wait` call per host however long it takes (calls are cut
at `LONG_POLL_SECONDS`, so that a host lost meanwhile is noticed between them). With several
JAX processes, a process that does not commit learns the end from the commit or failure marker
in storage. A failed save is aborted on every writer and raised once, as `CheckpointError`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Executor, as_completed
from dataclasses import dataclass, field
from typing import Any

from colocar.errors import CheckpointError, ColocarError, HostLostError

from ..store.steps import StepDirs
from .topology import Topology
from .writers import Writers

LONG_POLL_SECONDS = 10.0  # one wait call to a writer at most (a hung host is noticed between calls)


def save_failed(step: int, error: str) -> CheckpointError:
    """The error a failed save of `step` raises (once prefixed, whoever wrote the cause)."""
    prefix = f"save of step {step} failed: "
    return CheckpointError(error if error.startswith(prefix) else prefix + error)


@dataclass
class SaveStats:
    """What the last save cost; `arena_wait_seconds` > 0 means the arena was the bottleneck."""

    step: int = -1
    bytes: int = 0
    pieces: int = 0
    blocked_seconds: float = 0.0  # how long save() held the caller
    arena_waits: int = 0  # pieces that found the arena full (the budget is below the checkpoint)
    arena_wait_seconds: float = 0.0  # part of blocked_seconds spent waiting for writers to free blocks
    durable_seconds: float | None = None  # from save() to the commit marker, once known
    hosts: dict[int, dict[str, Any]] = field(default_factory=dict)


@dataclass
class Save:
    """One save in flight."""

    step: int
    hosts: list[int]
    started: float
    stats: SaveStats
    attempt: str
    begun: float = 0.0
    writers: dict[int, Any] = field(default_factory=dict)  # host index -> its writer
    ended: dict[int, dict[str, Any]] = field(default_factory=dict)  # hosts whose part ended: status


class InFlight:
    """The saves in flight, oldest first, and failures seen but not raised yet."""

    def __init__(
        self, topology: Topology, steps: StepDirs, writers: Writers, senders: Executor, commit_timeout: float
    ):
        self.topology = topology
        self.steps = steps
        self.commit_timeout = commit_timeout
        self.saves: deque[Save] = deque()
        self.unreported: list[CheckpointError] = []  # failures seen by stats(), raised by save/wait
        self._writers = writers
        self._senders = senders

    def wait_all(self, timeout: float | None) -> None:
        """Until every save is committed; raises the first failure (once)."""
        if self.unreported:  # a failure stats() saw is raised once, as by reap
            raise self.unreported.pop(0)
        while self.saves:
            self.wait_one(self.saves[0], timeout)

    def wait_one(self, record: Save, timeout: float | None) -> None:
        """Long-polls `record`'s writers (LONG_POLL_SECONDS a call at most) until it ended."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            poll = LONG_POLL_SECONDS
            if deadline is not None:
                poll = max(0.0, min(poll, deadline - time.monotonic()))
            if self._poll(record, wait=poll):
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"step {record.step} is not committed after {timeout} s")

    def reap(self, raise_errors: bool = True) -> None:
        """Drops saves that ended; raises the first failure not reported yet (once)."""
        while self.saves:
            try:
                if not self._poll(self.saves[0], wait=0.0):
                    break
            except CheckpointError as e:
                self.unreported.append(e)
        if raise_errors and self.unreported:
            raise self.unreported.pop(0)

    def _poll(self, record: Save, wait: float) -> bool:
        """True once `record` is committed (and forgets it), waiting up to `wait` s for it;
        raises CheckpointError if it failed."""
        primary = self.topology.primary
        try:
            status = self.wait_hosts(record, wait)
            if primary not in status:
                return self._poll_commit(record, status, wait)
        except CheckpointError:
            self.forget(record)
            raise
        if status[primary]["state"] == "committed":
            # The writer's clock: from begin() to the commit marker (retention not included).
            record.stats.durable_seconds = record.begun - record.started + status[primary]["seconds"]
            record.stats.hosts = status
            self.forget(record)
            return True
        return False

    def _poll_commit(self, record: Save, status: dict[int, dict[str, Any]], wait: float) -> bool:
        """Multi-controller, not process 0: once this process's part is durable, the commit
        marker (or another host's failure marker) in storage tells how the save ended."""
        if not all(s["state"] == "done" for s in status.values()):
            return False
        if self.steps.is_committed_by(record.step, record.attempt):
            record.stats.durable_seconds = time.monotonic() - record.started
            record.stats.hosts = status
            self.forget(record)
            return True
        failure = self.steps.failure(record.step, record.attempt)
        if failure is not None:
            raise save_failed(record.step, failure)
        if time.monotonic() - record.started > self.commit_timeout:
            raise CheckpointError(
                f"step {record.step} was not committed within commit_timeout "
                f"({self.commit_timeout:.0f} s) of this process's part: is process 0 alive?"
            )
        time.sleep(min(wait, 0.2))
        return False

    def wait_hosts(self, record: Save, wait: float) -> dict[int, dict[str, Any]]:
        """This process's hosts' status of the save: one long-poll per host whose part has not
        ended yet, in parallel, each returning when it ended or after `wait` s. Raises (and
        aborts the save, which ends the other long-polls) as soon as a host failed."""
        pending = [h for h in record.writers if h not in record.ended]
        results: Iterator[dict[str, Any]]
        if len(pending) > 1 and wait > 0:
            futures = [self._senders.submit(self._status, record, h, wait) for h in pending]
            results = (future.result() for future in as_completed(futures))
        else:
            results = (self._status(record, h, wait) for h in pending)
        latest = {}
        for status in results:
            if status["state"] == "failed":
                self.abort(record, status["error"])
                raise save_failed(record.step, status["error"])
            h = status["host"]
            latest[h] = status
            if status["state"] == "committed" or (status["state"] == "done" and h != self.topology.primary):
                record.ended[h] = status
        return {**latest, **record.ended}

    def _status(self, record: Save, h: int, wait: float) -> dict[str, Any]:
        """Host h's writer's status of the save (waiting up to `wait` s for it to end); a lost
        host fails the save (aborted, marked, raised as CheckpointError)."""
        try:
            status: dict[str, Any] = record.writers[h].wait(record.step, wait)
            return status
        except (HostLostError, ColocarError) as e:
            self.abort(record, f"host {h} was lost: {e}")
            self.mark_failed(record, h, f"host {h} was lost mid-save: {e}")
            raise save_failed(
                record.step,
                f"host {h} ({self.topology.host(h).name}) was lost mid-save ({e}); the step will not be "
                "committed, earlier steps are intact",
            ) from e

    def forget(self, record: Save) -> None:
        """The save ended: no more calls about it (writers replaced meanwhile can go now)."""
        if record in self.saves:
            self.saves.remove(record)
        record.writers = {}
        if not self.saves:
            self._writers.settle()

    def abort(self, record: Save, reason: str) -> None:
        """Tells the writers to drop the step (best effort: some may be gone)."""
        for writer in record.writers.values():
            try:
                writer.abort(record.step, reason)
            except Exception:
                pass

    def mark_failed(self, record: Save, host: int, error: str) -> None:
        """Tells the committing sidecar (and other processes) at once that a host's part is
        lost (best effort)."""
        try:
            self.steps.mark_failed(record.step, host, record.attempt, error)
        except Exception:
            pass
