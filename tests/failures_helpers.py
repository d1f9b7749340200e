"""What the failure tests share: waiting helpers, usage counters, and the shipped functions and
classes they call (the sidecars import this module to run them).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import colocar
from colocar.controller_bridge.cluster import Host

MiB = 1 << 20
DEADLINE = 30.0  # seconds any expected event may take before the test fails


# --- helpers ------------------------------------------------------------------------------------


def in_thread(fn: Callable[[], Any], timeout: float = DEADLINE) -> tuple[Any, BaseException | None]:
    """Runs fn in a thread; (value, exception); fails if it has not finished within `timeout`."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"call did not return within {timeout} s"
    return box.get("value"), box.get("error")


def usage(host: Host) -> tuple[int, int, int]:
    """(objects, sessions, bytes used in the default pool) on the host."""
    s = host.stats()
    return s["objects"], s["sessions"], s["pools"]["default"]["used"]


def arena_files(shm_dir: str) -> list[str]:
    return os.listdir(shm_dir) if os.path.isdir(shm_dir) else []


# --- shipped code used by the tests (the sidecars import this module) --------------------------
class CustomError(Exception):
    """A user exception class that the controller can rebuild."""

    def __init__(self, message: str, code: int = 0):
        super().__init__(message, code)
        self.code = code


class UnrebuildableError(Exception):
    """Pickles, but cannot be unpickled (its __init__ needs two arguments, args holds one)."""

    def __init__(self, left: str, right: str):
        super().__init__(f"{left} and {right}")


@colocar.colocated
def raise_value_error(n):
    raise ValueError(f"bad value {n}")  # the remote traceback shows this line


@colocar.colocated
def raise_custom(n):
    raise CustomError(f"custom failure {n}", code=n)


@colocar.colocated
def raise_unrebuildable():
    raise UnrebuildableError("left", "right")


@colocar.colocated
def raise_with_lock():
    e = RuntimeError("holds a lock")
    e.lock = threading.Lock()
    raise e


@colocar.colocated
def echo(*args, **kwargs):
    return args, kwargs


@colocar.colocated
def make_lock():
    return threading.Lock()


@colocar.colocated
def mark_and_sleep(path, seconds):
    """Signals that it started (creates `path`), then sleeps."""
    with open(path, "w"):
        pass
    time.sleep(seconds)
    return seconds


@colocar.colocated
def mark_and_wait(started, stop, limit=60.0):
    """Signals that it started, then waits until `stop` exists (at most `limit` s)."""
    with open(started, "w"):
        pass
    deadline = time.monotonic() + limit
    while not os.path.exists(stop) and time.monotonic() < deadline:
        time.sleep(0.02)
    return os.path.exists(stop)


@colocar.colocated(timeout=1)
def wait_with_timeout(started, stop):
    with open(started, "w"):
        pass
    deadline = time.monotonic() + 10
    while not os.path.exists(stop) and time.monotonic() < deadline:
        time.sleep(0.02)
    return "finished"


@colocar.colocated_class
class Holder:
    """A remote object that holds arena memory."""

    def __init__(self, nbytes, pool="default"):
        self.arrays = []
        self.grab(nbytes, pool)

    def grab(self, nbytes, pool="default"):
        array = colocar.shm.empty((nbytes,), np.uint8, pool=pool)
        array[:] = len(self.arrays) + 1
        self.arrays.append(array)
        return len(self.arrays)

    def check(self):
        return all(bool((a == i + 1).all()) for i, a in enumerate(self.arrays))

    def drop(self):
        self.arrays.clear()


@colocar.colocated_class
class Counter:
    def __init__(self):
        self.n = 0

    def bump(self):
        self.n += 1
        return self.n

    def value(self):
        return self.n


@colocar.colocated
def arena_sum(x):
    return int(x.sum())


@colocar.colocated
def make_array(n, value, pool="default"):
    out = colocar.shm.empty((n,), np.uint8, pool=pool)
    out[:] = value
    return out
