"""The per-batch work of one host's pipeline in its sidecar: one thread, one selector.

The pump waits on the workers' pipes, the batch feed's socket and a wake-up pipe. On each
worker's report it records the batch, sends the finished batches in order to the feed (or leaves
them for `wait`, the call path), and gives every free ring slot to the least busy worker. A
batch thus costs the sidecar one wake-up, not a hand-over between threads.

Slots lent to the feed come back on the ring's board without a message while every worker has
work queued; the pump looks at the board at each report. When a worker idles for want of a
slot, the ring asks the controller to signal (a byte on the feed socket), and the pump also
wakes when a lease in the sidecar is dropped (the call path) or after `RECHECK_SECONDS`, and
reports a starved ring after `starve` seconds.
"""

from __future__ import annotations

import os
import selectors
import socket
import threading
import time
from typing import Any

from colocar.protocol.messages import Build, BuildFailed, Built, FeedMessage, receive_pickled, send_pickled
from colocar.sidecar import instruments

from .errors import PipelineError

# A pump waiting for a slot reads the board this often: the controller's signal that it gave a
# slot back can be lost (the board has no memory fence, see "Ordering" in shm/ring.py), and
# this look is what finds the slot then. Not an optimisation: the protocol relies on it.
RECHECK_SECONDS = 0.05


class Pump:
    """A host pipeline's state and its pump thread (neither holds the LoaderHost, so it can be
    collected and its finalizer stop them)."""

    def __init__(self, ring: Any, workers: list, conns: list, num_batches: int | None, host: str):
        self.ring = ring
        self.workers = workers
        self.conns = conns  # one pipe per worker
        self.assigned = [0] * len(conns)  # per worker: batches sent and not reported yet
        self._tasks: dict[int, int] = {}  # batch sent and not reported yet -> its worker
        self.num_batches = num_batches
        self.host = host
        self.done: dict[int, Built | BuildFailed] = {}
        self.cond = threading.Condition()
        self.stopped = False
        self.failure: str | None = None
        self.bad_records = 0
        self.produced = 0
        self.started = time.monotonic()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._wake_lock = threading.Lock()
        self._feed: socket.socket | None = None
        self._feed_next = 0  # the next batch the feed gets
        self._feed_over = False  # "end" or "error" sent: only slots come back now
        self._starving_since: float | None = None  # a worker idle and no slot free since then
        self._thread: threading.Thread | None = None
        instruments.watch_pipeline(self)  # its ring's occupancy, while it runs

    # --- the controller's side: call path, feed attachment, stop -------------------------
    def start(self, first: int, starve: float) -> None:
        self._thread = threading.Thread(target=self._run, args=(first, starve), daemon=True)
        self._thread.start()

    def wait(self, k: int) -> Built | BuildFailed | None:
        """Batch k's report (the call path); None once the pipeline is stopped."""
        with self.cond:
            while k not in self.done:
                if self.stopped:
                    return None
                if self.failure:
                    raise PipelineError(self.failure)
                self.cond.wait(0.5)
            return self.done.pop(k)

    def take(self, k: int, message: Built | BuildFailed) -> int:
        """Batch k's slot from its worker's report (counted as produced); a failed batch gives
        its slot back and raises PipelineError naming the batch, host and record."""
        if isinstance(message, BuildFailed):
            self.ring.abandon(message.slot)
            raise PipelineError(f"batch {k} on {self.host}: {message.text}\n{message.traceback}")
        self.bad_records += message.bad
        self.produced += 1
        instruments.batch_finished(message.bad)
        return int(message.slot)

    def attach_feed(self, sock: socket.socket, first: int) -> None:
        """From now on the pump sends batches `first, first + 1, ...` over `sock`."""
        with self.cond:
            if self.stopped:
                sock.close()
                return
            self._feed_next = first
            self._feed = sock
        self.wake()

    def wake(self) -> None:
        with self._wake_lock:  # never a write to the number of a closed (and reused) descriptor
            if self._wake_w < 0:
                return
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:  # full: a wake-up is pending anyway
                pass

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        self.wake()
        for conn in self.conns:
            try:
                send_pickled(conn, None)
            except (OSError, ValueError):
                pass
        for w in self.workers:
            w.join(timeout=5)
            if w.is_alive():
                w.kill()
                w.join(timeout=5)
        for conn in self.conns:  # the pump let go of them when it saw `stopped`
            conn.close()
        self.ring.close()
        if self._thread is None:  # never started: nothing else closes the rest
            self._close()

    # --- the pump thread -------------------------------------------------------------------
    def _run(self, first: int, starve: float) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        for w, conn in enumerate(self.conns):
            selector.register(conn.fileno(), selectors.EVENT_READ, w)
        allocator = self.ring.allocator
        allocator.add_release_listener(self._on_release)
        self._next_task = first
        try:
            while not (self.stopped and self._feed is None):
                if self.stopped:  # the feed stays served until its slots are back
                    self._unregister_workers(selector)
                    if not self._feed_over:  # not the data's end: a controller still reading must know
                        self._send(self._feed_next, tail=("stopped",))
                else:
                    self._check_starved(starve)
                    self._dispatch()
                    self._deliver()
                starving = self._starving_since is not None and not self.stopped
                for key, _ in selector.select(RECHECK_SECONDS if starving else None):
                    if key.data == "wake":
                        os.read(self._wake_r, 4096)
                        if self._feed is not None and self._feed.fileno() not in selector.get_map():
                            selector.register(self._feed.fileno(), selectors.EVENT_READ, "feed")
                    elif key.data == "feed":
                        self._feed_signal(selector)
                    elif not self.stopped:
                        self._report(selector, key)
        except BaseException as e:
            with self.cond:
                self.failure = self.failure or f"the pipeline's pump failed: {type(e).__name__}: {e}"
                self.cond.notify_all()
            raise
        finally:
            allocator.remove_release_listener(self._on_release)
            selector.close()
            self._close()

    def _on_release(self) -> None:
        """A lease was dropped in the sidecar (under the allocator's lock): look if we wait."""
        if self._starving_since is not None:
            self.wake()

    def _idle_worker(self) -> bool:
        return min(self.assigned) == 0

    def _dispatch(self) -> None:
        """Gives each free slot's batch to the least busy worker."""
        while self.num_batches is None or self._next_task < self.num_batches:
            try:
                slot = self.ring.try_acquire(urgent=self._idle_worker())
            except RuntimeError:  # the ring closed: we are stopping
                return
            if slot is None:
                if self._idle_worker():
                    self._starving_since = self._starving_since or time.monotonic()
                return
            self._starving_since = None
            w = min(range(len(self.conns)), key=self.assigned.__getitem__)
            try:
                send_pickled(self.conns[w], Build(self._next_task, slot))
            except (OSError, ValueError):  # that worker is gone; its pipe's end reports it
                self.ring.abandon(slot)
                return
            self.assigned[w] += 1
            self._tasks[self._next_task] = w
            self._next_task += 1

    def _report(self, selector: selectors.BaseSelector, key: selectors.SelectorKey) -> None:
        w, conn = key.data, self.conns[key.data]
        try:
            message: Built | BuildFailed = receive_pickled(conn)
        except (EOFError, OSError):
            selector.unregister(key.fd)
            worker = self.workers[w]
            worker.join(timeout=1)
            lost = min((k for k, x in self._tasks.items() if x == w), default=None)
            with self.cond:
                self.failure = self.failure or (
                    f"pipeline worker process {worker.pid} died (exit code {worker.exitcode})"
                    + ("" if lost is None else f" while batch {lost} was being built")
                )
                self.cond.notify_all()
            return
        self.assigned[w] -= 1
        self._tasks.pop(message.k, None)
        with self.cond:
            self.done[message.k] = message
            self.cond.notify_all()

    def _check_starved(self, starve: float) -> None:
        since = self._starving_since
        if since is not None and time.monotonic() - since > starve and self.failure is None:
            with self.cond:
                self.failure = str(self.ring.starved(starve))
                self.cond.notify_all()

    def _deliver(self) -> None:
        """Sends the finished batches, in order, to the feed."""
        if self._feed is None or self._feed_over:
            return
        while True:
            k = self._feed_next
            if self.num_batches is not None and k >= self.num_batches:
                self._send(k, tail=("end",))
                return
            with self.cond:
                message = self.done.pop(k, None)
            if message is None:
                if self.failure:
                    self._send(k, tail=("error", f"batch {k} on {self.host}: {self.failure}"))
                return
            try:
                slot = self.take(k, message)
            except PipelineError as e:
                self._send(k, tail=("error", str(e)))
                return
            if not self.ring.lend(slot) or not self._send(k, slot):
                self.ring.return_lent()  # the controller is gone
                self._feed_over = True
                return
            self._feed_next = k + 1

    def _send(self, k: int, slot: int = -1, tail: tuple | None = None) -> bool:
        if tail is not None:
            self._feed_over = True
        assert self._feed is not None
        try:
            self._feed.sendall(FeedMessage(k, slot, self.bad_records, tail).pack())
            return True
        except OSError:
            return False

    def _feed_signal(self, selector: selectors.BaseSelector) -> None:
        """The controller gave slots back (and the ring waits), or went away (all come back)."""
        assert self._feed is not None
        try:
            data = self._feed.recv(4096)
        except OSError:
            data = b""
        if data:
            self.ring.reclaim_lent()
            return
        selector.unregister(self._feed.fileno())
        self.ring.return_lent()
        self._feed.close()
        self._feed = None
        self._feed_over = True

    def _unregister_workers(self, selector: selectors.BaseSelector) -> None:
        for key in list(selector.get_map().values()):
            if isinstance(key.data, int):
                selector.unregister(key.fd)

    def _close(self) -> None:
        """Once: closes the wake-up pipe and the feed (its lent slots come back)."""
        with self._wake_lock:
            if self._wake_w < 0:
                return
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_w = -1
        if self._feed is not None:
            self.ring.return_lent()
            self._feed.close()
