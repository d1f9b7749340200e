"""Small helpers shared by the test modules (import as `from helpers import ...`)."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

import colocar
from colocar.demo.gcs import FakeGcs as FakeGcs  # the demo's starter: the same server, the same way

DEADLINE = 30.0
PROGRAMS = Path(__file__).resolve().parent / "programs"


def running(pids: list[int]) -> list[int]:
    """Those of `pids` whose processes still run (a zombie nobody reaped has ended)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def program(name: str) -> str:
    """The path of tests/programs/<name>.py: a program a test runs as `sys.executable <path> args`."""
    return str(PROGRAMS / f"{name}.py")


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = DEADLINE) -> Any:
    """Polls until predicate() is truthy and returns its value; fails after `timeout` seconds.

    Tests wait on events with generous deadlines; they never assert how long something took.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


@contextlib.contextmanager
def recorded_stdout() -> Iterator[io.StringIO]:
    """Records what this process prints to sys.stdout inside the block. Forwarded log lines come
    from a background thread; capfd and capsys truncate their buffer after each read, so a line
    written between their read and truncate is lost or cut. This record is only appended to."""
    with contextlib.redirect_stdout(io.StringIO()) as record:
        yield record


def printed_until(record: io.StringIO, text: str, timeout: float = DEADLINE) -> str:
    """The record once it contains `text` or `timeout` s passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and text not in record.getvalue():
        time.sleep(0.05)
    return record.getvalue()


# --- shipped functions shared by test modules -----------------------------------------------------
@colocar.colocated
def sidecar_pid():
    return os.getpid()


@colocar.colocated(processes=True)
def worker_pid():
    return os.getpid()


def sigstop(pid: int) -> None:
    """SIGSTOP to `pid`, and waits until each of its threads has stopped: `kill` returns before
    a thread running on another core takes the signal, and in between it may still answer."""

    def state(task: str) -> str:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                return f.read().rpartition(")")[2].split()[0]
        except FileNotFoundError:  # the thread ended meanwhile
            return "T"

    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: all(state(t) in "tT" for t in os.listdir(f"/proc/{pid}/task")), f"process {pid} to stop")


def kill_if_stopped(process: subprocess.Popen) -> None:
    """Kills a sidecar left stopped (SIGSTOP) by a test: a stopped one cannot drain at close.
    A process that exits meanwhile (another thread of the cluster may reap it) is left alone."""
    try:
        stopped = process.poll() is None and psutil.Process(process.pid).status() == psutil.STATUS_STOPPED
    except psutil.NoSuchProcess:
        return
    if stopped:
        process.kill()
        process.wait(timeout=30)
