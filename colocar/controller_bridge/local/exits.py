"""Exit watch: a local sidecar that dies is marked lost at once, not at the next heartbeat.

Runs in the controller of a `local_cluster`. One daemon thread waits on a Linux pidfd per
sidecar process (readable once the process exits) and calls that process's callback, which
marks its host's session lost. Without it a killed sidecar is noticed by the heartbeat loop,
up to `heartbeat_seconds` later: in an elastic run that delay is part of every recovery. Where
pidfds are missing (not Linux, a kernel before 5.3) nothing is watched and the heartbeat
notices, as before.
"""

from __future__ import annotations

import os
import selectors
import threading
from collections.abc import Callable


class ExitWatch:
    """Calls `on_exit()` once each watched process has exited (from the watch's thread)."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="colocar-exit-watch", daemon=True)
        self._thread.start()

    def watch(self, pid: int, on_exit: Callable[[], None]) -> bool:
        """Watches `pid`; False where pidfds are missing or the process is already reaped."""
        pidfd_open = getattr(os, "pidfd_open", None)
        if pidfd_open is None:
            return False
        try:
            fd = pidfd_open(pid)
        except OSError:
            return False
        with self._lock:
            if self._closed:
                os.close(fd)
                return False
            self._selector.register(fd, selectors.EVENT_READ, on_exit)
        os.write(self._wake_w, b"w")  # the loop picks the new fd up at its next select
        return True

    def _loop(self) -> None:
        while True:
            events = self._selector.select()
            with self._lock:
                if self._closed:
                    return
                exited = [(key.fd, key.data) for key, _ in events if key.fd != self._wake_r]
                for fd, _ in exited:
                    self._selector.unregister(fd)
                    os.close(fd)
                if any(key.fd == self._wake_r for key, _ in events):
                    os.read(self._wake_r, 4096)
            for _, on_exit in exited:
                on_exit()

    def close(self) -> None:
        """Stops the thread and closes every descriptor; no callback runs after it returns
        (except one already running)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.write(self._wake_w, b"x")
        self._thread.join(timeout=10)
        with self._lock:
            for key in list(self._selector.get_map().values()):
                if key.fd != self._wake_r:
                    os.close(key.fd)
            self._selector.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
