"""Program order for the calls of one controller thread to one host.

Each (thread, host) pair has a lane: a call is sent only when the lane's previous call has
completed or was abandoned. A call cut short (an interrupt, a timeout, `future.cancel()`) is
abandoned: its lane goes on at once, and its reply, if one still comes, goes to `discard`,
never to another call.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, InvalidStateError
from typing import Any

from .transport import Done

Send = Callable[[Done], None]  # starts a call; its `done(reply, error)` runs once it ends


class LaneFuture(Future):
    """The future of a call in its lane (see `Lanes.submit`).

    `abandon()` gives up on a call that was sent: the future raises CancelledError and the
    lane's next call goes at once. The lane moves on once per call, whichever comes first.
    """

    def __init__(self, send: Send, unsent: Callable[[], None] | None):
        super().__init__()
        self.send = send
        self.unsent = unsent  # runs if the call is cancelled before it was sent
        self.next: Callable[[], None] = lambda: None
        self._moved_on = threading.Lock()

    def move_lane_on(self) -> None:
        if self._moved_on.acquire(blocking=False):
            self.next()

    def abandon(self) -> bool:
        """Cancels a queued call, or resolves a running one as cancelled and frees its lane;
        False if it had finished."""
        if self.cancel():
            return True
        if not settle(self.set_exception, CancelledError("the call was abandoned")):
            return False
        self.move_lane_on()
        return True


def settle(set_outcome: Callable[[Any], None], value: Any) -> bool:
    """Sets a future's outcome; False if it already had one (an abandoned call's late reply)."""
    try:
        set_outcome(value)
    except InvalidStateError:
        return False
    return True


class _Lane:
    __slots__ = ("pending", "busy")

    def __init__(self) -> None:
        self.pending: collections.deque[LaneFuture] = collections.deque()
        self.busy = False


class Lanes:
    """The lanes of one host's calls, one per controller thread."""

    def __init__(self, discard: Callable[[Any], None]):
        self._discard = discard
        self._lanes: dict[int, _Lane] = {}
        self._lock = threading.Lock()

    def submit(self, send: Send, unsent: Callable[[], None] | None = None) -> LaneFuture:
        """Runs `send(done)` (which starts a call) after this thread's earlier calls to this
        host have completed or were abandoned; the returned future resolves to the reply.
        `unsent` runs if the call is cancelled while queued."""
        future = LaneFuture(send, unsent)
        key = threading.get_ident()
        with self._lock:
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = _Lane()
            future.next = functools.partial(self._pump, key, lane)
            lane.pending.append(future)
            if lane.busy:
                return future
            lane.busy = True
        self._pump(key, lane)
        return future

    def idle(self) -> bool:
        """True when this thread has no call in flight to this host (sync calls may go direct)."""
        lane = self._lanes.get(threading.get_ident())
        return lane is None or not lane.busy

    def _pump(self, key: int, lane: _Lane) -> None:
        """Sends the lane's next call; the lane moves on when it completes or is abandoned."""
        while True:
            with self._lock:
                if not lane.pending:
                    lane.busy = False
                    if self._lanes.get(key) is lane:
                        del self._lanes[key]
                    return
                future = lane.pending.popleft()
            if future.set_running_or_notify_cancel():
                break
            if future.unsent is not None:
                future.unsent()

        def done(reply: Any, error: BaseException | None) -> None:
            if error is not None:
                settle(future.set_exception, error)
            elif not settle(future.set_result, reply):
                self._discard(reply)
            future.move_lane_on()

        try:
            future.send(done)
        except BaseException as e:
            settle(future.set_exception, e)
            future.move_lane_on()
            if not isinstance(e, Exception):
                raise  # an interrupt of the thread that sends: it is that thread's to handle
