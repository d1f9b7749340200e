"""Routes what shipped functions print to the controller that called them.

The sidecar replaces sys.stdout and sys.stderr with a router: text written by a thread that is
running a call goes, line by line, to that call's session (streamed to the controller, which
prints it prefixed with the host); anything else goes to the sidecar's own streams.
"""

from __future__ import annotations

import io
import sys
import threading
from collections.abc import Callable
from typing import Any

_current = threading.local()


class _Router(io.TextIOBase):
    def __init__(self, fallback: Any):
        self._fallback = fallback

    def write(self, text: str) -> int:
        sink = getattr(_current, "sink", None)
        if sink is None:
            return self._fallback.write(text)
        buffer = _current.buffer + text
        *lines, _current.buffer = buffer.split("\n")
        for line in lines:
            sink(line)
        return len(text)

    def flush(self) -> None:
        if getattr(_current, "sink", None) is None:
            self._fallback.flush()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._fallback, "encoding", "utf-8")

    def isatty(self) -> bool:
        return False


def install() -> None:
    """Puts the routers in place (idempotent)."""
    if not isinstance(sys.stdout, _Router):
        sys.stdout = _Router(sys.stdout)
    if not isinstance(sys.stderr, _Router):
        sys.stderr = _Router(sys.stderr)


class routed_to:  # noqa: N801 - used like a function: `with routed_to(sink):`
    """Within the block, this thread's output goes to `sink` one line at a time."""

    __slots__ = ("_sink", "_previous")

    def __init__(self, sink: Callable[[str], None] | None):
        self._sink = sink

    def __enter__(self) -> None:
        self._previous = getattr(_current, "sink", None), getattr(_current, "buffer", "")
        _current.sink, _current.buffer = self._sink, ""

    def __exit__(self, *exc: Any) -> None:
        if self._sink is not None and _current.buffer:
            self._sink(_current.buffer)
        _current.sink, _current.buffer = self._previous
