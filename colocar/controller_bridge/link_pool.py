"""How a future's reply comes back over the local link (runs in the controller).

A future's call is sent at once, by the thread that starts it, and its reply is read by the
thread that waits for it (`LinkReply.wait`): no other thread takes part, which takes a thread
hand-off each way, and their share of the GIL, off a future's round trip. A reply that nobody
waits for that way (a callback, `done()`, a call queued behind it, an abandoned call) is
`detach`ed: one of the pool's threads reads it, as it reads on a reply that a wait with a
limit (`result(timeout)`) left unfinished.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError
from typing import Any, Protocol

from .link_client import NotYet, PendingReply
from .sigint import sigint_held

Done = Callable[[Any, BaseException | None], None]  # (reply, None) or (None, error)


class Job(Protocol):
    def run_pooled(self) -> None: ...

    def cancel(self) -> None: ...


class LinkReply:
    """A call sent on the local link: its reply goes to `done` once read, by the thread that
    waits for it (`wait`) or by a pool thread (`detach`), whichever claims it first."""

    __slots__ = ("_pending", "_done", "_pool")

    def __init__(self, pending: PendingReply, done: Done, pool: Callable[[], LinkPool]):
        self._pending, self._done, self._pool = pending, done, pool

    def wait(self, until: float | None = None) -> bool:
        """Reads the reply in this thread and hands it to `done`; False if another thread
        has it. Interrupted, the reply is drained and discarded (see `PendingReply.read`).
        Past `until` (a monotonic time) a pool thread reads the rest."""
        if not self._pending.claim():
            return False
        try:
            self._finish(until)
        except NotYet:
            self._to_pool()
        return True

    def detach(self) -> None:
        """A pool thread reads the reply, unless a reader has it already."""
        if self._pending.claim():
            self._to_pool()

    def _to_pool(self) -> None:
        """(Claimed) a pool thread reads the reply. Ctrl-C is held back meanwhile: a claimed
        reply that no thread reads would keep its socket, and its blocks, to the session's end."""
        with sigint_held():
            try:
                self._pool().submit(self)
            except RuntimeError:  # the pool closed (the transport did), or the interpreter exits
                self.cancel()

    def run_pooled(self) -> None:
        self._finish(None)

    def cancel(self) -> None:
        """(Claimed) the pool closed before reading the reply: it is drained and discarded."""
        self._pending.abandon()
        self._done(None, CancelledError())

    def _finish(self, until: float | None) -> None:
        try:
            reply = self._pending.read(until)
        except NotYet:
            raise
        except Exception as e:  # noqa: BLE001 - TransportError: the call's failure is its caller's
            self._done(None, e)
        else:
            self._done(reply, None)


class LinkPool:
    """Up to `size` threads, started as jobs need them; every job submitted has a thread of
    its own, idle or new, until `size` are busy (then jobs queue)."""

    def __init__(self, size: int, name: str):
        self._size, self._name = size, name
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0  # threads waiting, less the jobs queued for them (below 0: a backlog)
        self._closed = False

    def submit(self, job: Job) -> None:
        """Hands `job` to a thread. Refused at the interpreter's shutdown (a finalizer's call):
        daemon threads no longer run then, so the job would never end and its waiter hang."""
        if sys.is_finalizing():
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            start = self._idle <= 0 and self._threads < self._size
            if start:
                self._threads += 1  # a new thread, for this job
            else:
                self._idle -= 1  # an idle thread's, or (below 0) a backlog for the next free one
            self._jobs.put(job)
        if start:
            name = f"colocar-link-{self._name}_{self._threads - 1}"
            threading.Thread(target=self._work, name=name, daemon=True).start()

    def _work(self) -> None:
        jobs = self._jobs
        while True:
            job = jobs.get()
            if job is None:
                return
            job.run_pooled()
            del job
            with self._lock:
                self._idle += 1

    def close(self) -> None:
        """Jobs not started are cancelled; running ones finish; the threads end."""
        with self._lock:
            self._closed = True
            threads = self._threads
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
        for _ in range(threads):
            self._jobs.put(None)
