"""Ctrl-C held back while gRPC sets up a call (runs in the controller).

gRPC Python registers a non-blocking call (a future, a stream) on its channel and only then
counts it for the thread that completes the channel's calls. A KeyboardInterrupt between the
two strands the call: nothing ever completes it, and closing the channel (`close()`, or its
finalizer in a later garbage collection) waits for it forever. Python runs signal handlers in
the main thread only, so only there is the set-up wrapped; elsewhere it costs nothing.
"""

from __future__ import annotations

# `signal`'s own getsignal/signal turn handlers into enums by raising and catching an
# exception: 5-13 us a swap against under 1 us here, paid on every gRPC call of the main thread.
import _signal  # type: ignore[import-not-found]
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

_MAIN = threading.main_thread()


class sigint_held:  # noqa: N801 - used like a function: `with sigint_held():`
    """Runs the block with SIGINT's Python handler held back; a SIGINT that came meanwhile runs
    the handler (by default: raises KeyboardInterrupt) as the block ends, as if it had come
    just after. Blocks inside must not wait: the user's Ctrl-C waits for them."""

    __slots__ = ("_handler", "_came")

    def __enter__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        self._handler: Any = None
        # At exit (a finalizer's call) no handler is left to hold, and the modules are torn down.
        if _finalizing() or threading.current_thread() is not _MAIN:
            return
        self._came: list[FrameType | None] = []
        handler = _signal.signal(signal.SIGINT.value, self._hold)
        if callable(handler):
            self._handler = handler
        else:  # ignored, or the default action (no Python code runs): leave it so
            _signal.signal(signal.SIGINT.value, handler)

    def _hold(self, _signum: int, frame: FrameType | None) -> None:
        self._came.append(frame)

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        handler = self._handler
        if handler is None:
            return
        _signal.signal(signal.SIGINT.value, handler)
        if self._came:
            handler(signal.SIGINT, self._came[0])
