"""What the Ctrl-C tests share: delivering a real SIGINT at a chosen point, checking that
nothing is left, and the shipped functions they interrupt (the sidecars import this module).
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from helpers import wait_for

import colocar

DEADLINE = 30.0
QUICK = 120.0  # a deadline, not a timing: the interrupted call runs 600 s unless stopped


# --- delivering the interrupt -------------------------------------------------------------------
def run_interrupted(
    fn: Callable[[], Any], delay: float = 0.0, when: Callable[[], bool] | None = None
) -> tuple[bool, Any]:
    """Runs fn() in the main thread; SIGINT reaches this thread after `delay` s (or once `when()`
    holds) unless fn ended first. Returns (interrupted, value). A signal sent just as fn ended
    lands here too, never in the test's next line."""
    main = threading.main_thread().ident
    assert threading.get_ident() == main, "interrupt tests run in the main thread"
    lock = threading.Lock()
    state = {"over": False, "sent": False}

    def fire() -> None:
        while when is not None and not when():
            if state["over"]:
                return
            time.sleep(0.01)
        with lock:
            if state["over"]:
                return
            state["sent"] = True
        signal.pthread_kill(main, signal.SIGINT)  # type: ignore[arg-type]

    timer = threading.Timer(delay, fire)
    try:
        timer.start()
        try:
            value = fn()
        finally:
            with lock:
                state["over"] = True
            timer.cancel()
        if state["sent"]:  # sent but not yet raised: let it land here, not in the test's next line
            time.sleep(1.0)  # (Python drops a KeyboardInterrupt raised in a GC finalizer: then none)
        return False, value
    except KeyboardInterrupt:
        return True, None


def used(c: Any) -> list[int]:
    """Bytes in use in each host's default pool."""
    return [h.stats()["pools"]["default"]["used"] for h in c.hosts]


def use_at_rest(c: Any) -> list[int]:
    """`used(c)` once the garbage of earlier tests went back: their dropped views collected,
    and the releases they queued delivered (a baseline taken before that would see the arena
    use fall below it during the test)."""
    gc.collect()
    for host in c.hosts:
        host.connection.releases.flush(timeout=DEADLINE)
    return used(c)


def settled(c: Any, baseline: list[int]) -> None:
    """Waits until nothing of the interrupted calls is left: blocks, running calls."""
    gc.collect()
    wait_for(lambda: used(c) == baseline, f"the arena use to return to {baseline} (now {used(c)})")
    wait_for(
        lambda: all(h.stats()["abandoned_calls"] == 0 and h.stats()["in_flight"] == 0 for h in c.hosts),
        "the abandoned calls to end",
    )


# --- shipped code ---------------------------------------------------------------------------------
@colocar.colocated
def ident(x):
    return x


@colocar.colocated
def wait_for_file(path, limit=600.0):
    """Sleeps until `path` exists (at most `limit` s), then returns a value of its own."""
    deadline = time.monotonic() + limit
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    return f"wait_for_file({os.path.basename(path)}) result"


@colocar.colocated(processes=True)
def worker_sleep(started, seconds):
    """Writes its pid to `started`, then sleeps in a worker process."""
    with open(started + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(started + ".tmp", started)
    time.sleep(seconds)
    return "worker_sleep finished"


@colocar.colocated
def shifted(x, k, seconds):
    time.sleep(seconds)
    return x + k


@colocar.colocated(processes=True)
def shifted_in_worker(x, k, seconds):
    time.sleep(seconds)
    return x + k


@colocar.colocated
def shifted_items(x, k, n, seconds):
    for i in range(n):
        time.sleep(seconds)
        yield x + k + i


@colocar.colocated
def plus_one(x):
    return x + 1
