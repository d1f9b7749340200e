"""Deferred release of arena blocks, safe to trigger from garbage-collection finalizers.

A numpy view's finalizer may run in any thread at any allocation, even while that thread holds
an allocator lock, so it must neither take locks nor do I/O. `Reclaimer.push` only puts the
item on a `queue.SimpleQueue` (whose `put` is reentrant: made for finalizers); a daemon thread
takes items in batches and calls the real release function (an allocator free, or a Release
RPC). There is no file descriptor to wake the thread: a push after `close()` can never write
into a descriptor number the process has since reused (a socket, an arena file).
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

_STOP = object()  # the last item: the thread releases what came before it, then ends


class Reclaimer:
    """Runs `release(batch)` in a background thread for items pushed from anywhere."""

    def __init__(self, release: Callable[[list[Any]], None], name: str = "colocar-reclaimer"):
        self._release = release
        self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._pushed = 0
        self._done = 0
        self._progress = threading.Condition()  # notified after each batch (never by `push`)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def push(self, item: Any) -> None:
        """Queues one item; lock-free, callable from a finalizer. Ignored after `close()`."""
        if self._closed:
            return
        self._pushed += 1
        self._items.put(item)

    def flush(self, timeout: float = 10.0) -> bool:
        """Waits until everything pushed so far was released; True if it was."""
        target = self._pushed
        deadline = time.monotonic() + timeout
        with self._progress:
            while self._done < target:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._progress.wait(min(left, 0.1))
        return True

    def _run(self) -> None:
        stop = False
        while not stop:
            batch = [self._items.get()]
            while True:
                try:
                    batch.append(self._items.get_nowait())
                except queue.Empty:
                    break
            if _STOP in batch:
                stop = True
                batch = [item for item in batch if item is not _STOP]
            if batch:
                try:
                    self._release(batch)
                except Exception:  # a failed release must not kill the thread
                    traceback.print_exc()
                with self._progress:
                    self._done += len(batch)
                    self._progress.notify_all()

    def close(self) -> None:
        """Releases what is queued, then stops the thread."""
        if self._closed:
            return
        self._closed = True
        self._items.put(_STOP)
        self._thread.join(timeout=10)
