"""Deferred release of arena blocks, safe to trigger from garbage-collection finalizers.

A numpy view's finalizer may run in any thread at any allocation, even while that thread holds
an allocator lock, so it must neither take locks nor do I/O of consequence. `Reclaimer.push`
only appends to a deque and writes one byte to a pipe; a daemon thread drains the deque in
batches and calls the real release function (an allocator free, or a Release RPC).
"""

from __future__ import annotations

import collections
import os
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any


class Reclaimer:
    """Runs `release(batch)` in a background thread for items pushed from anywhere."""

    def __init__(self, release: Callable[[list[Any]], None], name: str = "colocar-reclaimer"):
        self._release = release
        self._items: collections.deque[Any] = collections.deque()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._closed = False
        self._pushed = 0
        self._done = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def push(self, item: Any) -> None:
        """Queues one item; lock-free, callable from a finalizer."""
        self._pushed += 1
        self._items.append(item)
        try:
            os.write(self._write_fd, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (a wake-up is already pending) or closed

    def flush(self, timeout: float = 10.0) -> bool:
        """Waits until everything pushed so far was released; True if it was."""
        target = self._pushed
        deadline = time.monotonic() + timeout
        while self._done < target:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def _run(self) -> None:
        while True:
            try:
                data = os.read(self._read_fd, 4096)
            except OSError:
                return
            batch = []
            while self._items:
                batch.append(self._items.popleft())
            if batch:
                try:
                    self._release(batch)
                except Exception:  # a failed release must not kill the thread
                    traceback.print_exc()
                self._done += len(batch)
            if not data or self._closed:
                return

    def close(self) -> None:
        """Releases what is queued, then stops the thread."""
        if self._closed:
            return
        self._closed = True
        try:
            os.write(self._write_fd, b"x")
        except OSError:
            pass
        self._thread.join(timeout=10)
        for fd in (self._read_fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass
