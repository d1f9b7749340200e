"""Ending with another process: the sidecar with its controller, a worker with its sidecar.

Runs in the sidecar and in its worker processes. Nothing colocar starts may outlive the process
it serves: a sidecar started by `local_cluster` ends with its controller (`--parent-pid`), and
every worker process (call workers, pipeline workers) ends with its sidecar, also when the
sidecar is killed outright (an OOM kill leaves no time to stop them). Workers fork from a
forkserver, so their parent is not the sidecar and `PR_SET_PDEATHSIG` would not do; instead a
daemon thread waits on a Linux pidfd of the watched process (readable once it exits: no
polling), or polls it every half second where pidfds are missing.
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable

POLL_SECONDS = 0.5  # without pidfds


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process now holds the number: ours is gone
        return False
    return True


def _wait_for_exit(pid: int, fd: int | None) -> None:
    if fd is not None:
        select.select([fd], [], [])
        os.close(fd)
        return
    while _alive(pid):
        time.sleep(POLL_SECONDS)


def on_exit(pid: int, callback: Callable[[], None], name: str = "colocar-lifeline") -> None:
    """Calls `callback()` on a daemon thread once process `pid` has exited (at once if it has)."""
    try:
        fd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        callback()
        return
    except (AttributeError, OSError):  # no pidfd here: poll
        fd = None

    def watch() -> None:
        _wait_for_exit(pid, fd)
        callback()

    threading.Thread(target=watch, name=name, daemon=True).start()


def end_with(pid: int) -> None:
    """Ends this process (exit status 1, no clean-up: what it holds belongs to `pid`'s work) as
    soon as process `pid` has exited. For worker processes, with their sidecar's pid."""
    on_exit(pid, lambda: os._exit(1))
