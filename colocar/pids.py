"""Which process a pid names: a pid kept with its process's start, as records and leases keep it.

A pid alone names some later process once its own has ended, so a record keeps the start too.
psutil's `create_time()` is wall-clock time (the boot time plus the ticks since boot), and the
boot time it adds moves whenever the clock is set: NTP stepping a fresh VM's clock, a VM
migrated or resumed. Compared across such a step, every live process looked gone: `colocar
clean` removed the work folder of a live cluster, and a live writer's lease could be taken.
So the start is kept as seconds since boot, with the boot's id, which no clock change moves;
the wall-clock `started` stays beside them for people and for records older versions wrote.
A pid means something only in the PID namespace it was read in (containers sharing a /tmp):
a record says which, and another namespace's pids are never judged here (`elsewhere`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import Any

import psutil

_SAME_START = 0.1  # seconds; starts are counted in clock ticks (10 ms)
_SAME_WALL_START = 1.5  # an older record's: the boot time is in whole seconds, and a slewed
# clock moves it by one


def boot_id() -> str:
    """This boot's id (Linux), or "" where the system has none to read."""
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    return ""


def pid_namespace() -> str:
    """This process's PID namespace (Linux), or "" where the system has none to read."""
    with contextlib.suppress(OSError):
        return os.readlink("/proc/self/ns/pid")
    return ""


def start_of(pid: int) -> dict[str, Any]:
    """What tells `pid`'s process from a later one with the same pid: to keep in a record and
    compare with `process_with`. Raises psutil.Error when no process has that pid."""
    process, since_boot = _with_start(pid)
    started = process.create_time()  # the one read with the boot time in `_with_start`
    return {"started": started, "since_boot": since_boot, "boot": boot_id(), "pidns": pid_namespace()}


def elsewhere(start: Mapping[str, Any]) -> bool:
    """Whether `start` was kept in another PID namespace of this boot: its pid names nothing
    here, and whether its process runs cannot be told (a process of another boot has ended)."""
    return start.get("boot") == boot_id() and start.get("pidns", pid_namespace()) != pid_namespace()


def _with_start(pid: int) -> tuple[psutil.Process, float]:
    """`pid`'s process and when it started, in seconds since boot: its wall-clock start less
    the boot time, both with the same boot time (read again if the clock moved it meanwhile)."""
    while True:
        boot = psutil.boot_time()
        process = psutil.Process(pid)
        started = process.create_time()
        if psutil.boot_time() == boot:
            return process, started - boot


def process_with(pid: int, start: Mapping[str, Any]) -> psutil.Process | None:
    """The process `pid` names if it is the one whose `start_of` is `start`; else None (it
    ended, and the pid is free or names another process)."""
    try:
        process, since_boot = _with_start(int(pid))
        if "since_boot" in start:
            same = start.get("boot") == boot_id() and abs(since_boot - start["since_boot"]) < _SAME_START
        else:  # written by an older version: its wall-clock start is all there is
            same = abs(process.create_time() - float(start["started"])) < _SAME_WALL_START
    except (psutil.Error, KeyError, TypeError, ValueError):
        return None
    return process if same else None
