"""Program order for the calls of one controller thread to one host.

Each (thread, host) pair has a lane: a call is sent only when the lane's previous call has
completed or was abandoned. A call cut short (an interrupt, a timeout, `future.cancel()`) is
abandoned: its lane goes on at once, and its reply, if one still comes, goes to `discard`,
never to another call.

A call sent at once (its lane was idle) may have its reply read by the thread that waits for
it (`LaneFuture.wait_inline`, over the local link). A call that nobody will wait for that way
is `detach`ed: its reply is read in the background. A call queued behind another is detached
when it is sent, and the call ahead of it at once: each lane's replies are always read.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, InvalidStateError
from typing import Any, Protocol

from .lean_future import LeanFuture


class Reader(Protocol):
    """Reads a sent call's reply, once (see `link_pool.LinkReply`)."""

    def wait(self, until: float | None = None) -> bool:
        """Reads the reply in this thread; False if another thread has it. Past `until` (a
        monotonic time) the rest is read in the background."""
        ...

    def detach(self) -> None:
        """Has the reply read in the background, unless a reader has it already."""
        ...


Send = Callable[["LaneFuture"], None]  # starts a call, which ends in the future's `finish`


class LaneFuture(LeanFuture):
    """The future of a call in its lane (see `Lanes.submit`).

    `send(future)` starts the call: it ends in `finish`, and a reply read later comes through
    the `Reader` given to `read_by`. `abandon()` gives up on a call that was sent: the future
    raises CancelledError and the lane's next call goes at once. The lane moves on once per
    call, whichever comes first.
    """

    __slots__ = ("send", "unsent", "next", "reader", "detached", "_discard")

    def __init__(
        self,
        send: Send,
        unsent: Callable[[], None] | None,
        discard: Callable[[Any], None],
        next_in_lane: Callable[[], None],
    ):
        super().__init__()
        self.send = send
        self.unsent = unsent  # runs if the call is cancelled before it was sent
        self.next = next_in_lane  # sends the lane's next call
        self.reader: Reader | None = None
        self.detached = False  # nobody waits inline: every reader reads in the background
        self._discard = discard

    def finish(self, reply: Any, error: BaseException | None) -> None:
        """The call ended: its outcome (a late reply of an abandoned call is discarded)."""
        if error is not None:
            settle(self.set_exception, error)
        elif not settle(self.set_result, reply):
            self._discard(reply)
        self.move_lane_on()
        self.reader = None  # the call ended: no cycle through its reply's reader is left

    def take(self) -> tuple[Send, Callable[[], None] | None]:
        """`send` and `unsent`, once (see `Lanes._pump`): the future then keeps no reference to
        its call, which holds the future (a cycle only the garbage collector would free)."""
        taken = self.send, self.unsent
        self.send, self.unsent = _sent, None
        return taken

    def read_by(self, reader: Reader | None) -> None:
        """The reply comes through `reader` (a call sent again replaces it)."""
        self.reader = reader
        if reader is not None and self.detached:
            reader.detach()

    def detach(self) -> None:
        """Nobody will wait for the reply inline: it is read in the background."""
        self.detached = True
        reader = self.reader
        if reader is not None:
            reader.detach()

    def wait_inline(self, until: float | None = None) -> None:
        """Reads the reply in this thread, unless it came or another thread reads it (then
        `result()` waits as usual); until `until` (a monotonic time), if given: a reply not
        read by then is read on in the background."""
        last: Reader | None = None  # the reader this thread read last
        while not self.detached and not self.done():
            reader = self.reader
            if reader is None or reader is last or not reader.wait(until):
                return
            last = reader

    def move_lane_on(self) -> None:
        """Sends the lane's next call, the first time only (the future's own lock decides)."""
        with self._lock:
            step, self.next = self.next, _moved_on
        step()

    def abandon(self) -> bool:
        """Cancels a queued call, or resolves a running one as cancelled and frees its lane
        (its reply is read in the background and discarded); False if it had finished."""
        if self.cancel():
            return True
        if not settle(self.set_exception, CancelledError("the call was abandoned")):
            return False
        self.move_lane_on()
        self.detach()
        return True


def _moved_on() -> None:
    """A lane future's `next` once its lane moved on."""


def _sent(_: LaneFuture) -> None:
    raise AssertionError("a call is sent once")


def settle(set_outcome: Callable[[Any], None], value: Any) -> bool:
    """Sets a future's outcome; False if it already had one (an abandoned call's late reply)."""
    try:
        set_outcome(value)
    except InvalidStateError:
        return False
    return True


class _Lane:
    __slots__ = ("pending", "busy", "current")

    def __init__(self) -> None:
        self.pending: collections.deque[LaneFuture] = collections.deque()
        self.busy = False
        self.current: LaneFuture | None = None  # the call last sent


class Lanes:
    """The lanes of one host's calls, one per controller thread."""

    def __init__(self, discard: Callable[[Any], None]):
        self._discard = discard
        self._lanes: dict[int, _Lane] = {}
        self._lock = threading.Lock()

    def submit(self, send: Send, unsent: Callable[[], None] | None = None) -> LaneFuture:
        """Runs `send(future)` (which starts the call) after this thread's earlier calls to
        this host have completed or were abandoned; the returned future resolves to the reply.
        `unsent` runs if the call is cancelled while queued."""
        key = threading.get_ident()
        with self._lock:
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = _Lane()
            future = LaneFuture(send, unsent, self._discard, functools.partial(self._pump, key, lane, False))
            lane.pending.append(future)
            busy, ahead = lane.busy, lane.current
            lane.busy = True
        if busy:
            if ahead is not None:
                ahead.detach()  # this call waits for its reply: nobody may wait to read it inline
            return future
        self._pump(key, lane, True)
        return future

    def idle(self) -> bool:
        """True when this thread has no call in flight to this host (sync calls may go direct)."""
        lane = self._lanes.get(threading.get_ident())
        return lane is None or not lane.busy

    def _pump(self, key: int, lane: _Lane, direct: bool) -> None:
        """Sends the lane's next call (`direct`: from `submit`, its lane idle); the lane moves
        on when it completes or is abandoned. A call that waited in the lane is detached."""
        while True:
            with self._lock:
                if not lane.pending:
                    lane.busy = False
                    lane.current = None
                    if self._lanes.get(key) is lane:
                        del self._lanes[key]
                    return
                future = lane.current = lane.pending.popleft()
            running = future.set_running_or_notify_cancel()
            send, unsent = future.take()
            if running:
                break
            if unsent is not None:
                unsent()
        future.detached = future.detached or not direct
        try:
            send(future)
        except BaseException as e:
            settle(future.set_exception, e)
            future.move_lane_on()
            if not isinstance(e, Exception):
                raise  # an interrupt of the thread that sends: it is that thread's to handle
