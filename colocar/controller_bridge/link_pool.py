"""The threads that run a host's futures over the local link (runs in the controller).

A future's call is a `LinkJob`: it runs once, on one of the pool's threads, or not at all once
the pool closed (its `done` gets CancelledError). Lighter than a `ThreadPoolExecutor`, which
made a second future per call (with its condition and lock) only to call `done` when it ended.
(Running the job in the thread that waits for it, when no pool thread took it yet, saves
nothing: the thread that `submit` woke still contends for the GIL.)
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError
from typing import Any

Done = Callable[[Any, BaseException | None], None]  # (reply, None) or (None, error)


class LinkJob:
    """One call: `run()` gives the reply or raises; `done` hears how it ended, once (the claim
    makes a cancel at close and a pool thread's run exclusive)."""

    __slots__ = ("_run", "_done", "_claim")

    def __init__(self, run: Callable[[], Any], done: Done):
        self._run, self._done = run, done
        self._claim = threading.Lock()  # taken by whoever runs (or cancels) the job

    def run_pooled(self) -> None:
        """On a pool thread: runs the job unless it was cancelled."""
        if not self._claim.acquire(blocking=False):
            return
        try:
            reply = self._run()
        except BaseException as e:  # noqa: BLE001 - the call's failure is its caller's
            self._done(None, e)
        else:
            self._done(reply, None)

    def cancel(self) -> None:
        """The pool closed before the job ran: it never will."""
        if self._claim.acquire(blocking=False):
            self._done(None, CancelledError())


class LinkPool:
    """Up to `size` threads, started as jobs need them; every job submitted has a thread of
    its own, idle or new, until `size` are busy (then jobs queue)."""

    def __init__(self, size: int, name: str):
        self._size, self._name = size, name
        self._jobs: queue.SimpleQueue[LinkJob | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0  # threads waiting, less the jobs queued for them (below 0: a backlog)
        self._closed = False

    def submit(self, job: LinkJob) -> None:
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
