"""Small helpers shared by the test modules (import as `from helpers import ...`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

DEADLINE = 30.0


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
