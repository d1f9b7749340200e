"""Small helpers shared by the test modules (import as `from helpers import ...`)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

import colocar
from colocar.demo.gcs import FakeGcs as FakeGcs  # the demo's starter: the same server, the same way

DEADLINE = 30.0
PROGRAMS = Path(__file__).resolve().parent / "programs"


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


def captured_output_until(capfd: Any, text: str, timeout: float = DEADLINE) -> str:
    """Reads the captured stdout until it contains `text` (forwarded sidecar log lines arrive
    in the background) or `timeout` s passed; returns what was read."""
    deadline = time.monotonic() + timeout
    seen = ""
    while time.monotonic() < deadline and text not in seen:
        seen += capfd.readouterr().out
        time.sleep(0.05)
    return seen


# --- shipped functions shared by test modules -----------------------------------------------------
@colocar.colocated
def sidecar_pid():
    return os.getpid()


@colocar.colocated(processes=True)
def worker_pid():
    return os.getpid()


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
