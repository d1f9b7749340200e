"""The controller's end of a host's batch feed (runs in the controller / device owner).

When the controller maps a host's arena, each finished batch arrives as `(batch, slot)` over a
socket of the pipeline's own, and the slot goes back on the ring's board once nothing reads it
any more (see `host_backend` for the sidecar's end); otherwise the iterator falls back to calls.
"Nothing reads it" is decided one way: the batch's views all derive from one anchor array, and
the slot is queued when the anchor becomes unreachable (a weakref callback; `Feed` says more).
"""

from __future__ import annotations

import collections
import functools
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from colocar.controller_bridge.cluster import Host
from colocar.controller_bridge.sigint import sigint_held
from colocar.errors import HostLostError
from colocar.protocol.messages import FEED_HEADER, FeedMessage
from colocar.shm.ring import WAITING, board_words, store_load_hint

from .errors import PipelineError
from .layout import SlotLayout

_LENDING: set[Feed] = set()  # closed feeds whose batches still hold slots
HEADER = FEED_HEADER.size
AHEAD = 2  # a host with this many batches read but not yet taken is not woken for a slot


class Feed:
    """The controller's end of a host's batch feed (see `host_backend`): batches in, slots back.

    A slot comes back by reachability alone. Each batch handed out gets fresh per-device views
    of its slot (one per field and device, in `placed` order), all views of one new array over
    the slot's bytes, its **anchor** (a numpy view's base is the first array of its chain whose
    own base is no array: the anchor, over the slot's memoryview; so every array derived from
    these views, by numpy or through the buffer protocol, keeps the anchor alive). The anchor
    dies when nothing built on the slot is alive: the batch's arrays (JAX on CPU aliases the
    views and holds them until its deferred releases run, see `jax_compat.release_deferred`),
    numpy views of them, anything derived. A weakref callback then queues the slot, and
    `poll()` gives the queued slots back on the ring's board; once closed, the callback gives
    its slot back itself. The socket stays open (and the feed alive, in `_LENDING`) until the
    last slot is back, so the sidecar keeps every slot a live batch reads. Per batch this costs
    one anchor, its weakref and the views (`_view_recipe`).
    """

    def __init__(self, host: Host, info: dict[str, Any], layout: SlotLayout, placed: list[tuple[Any, int]]):
        conn = host.connection
        self.host = host
        self._conn = conn
        assert conn.blocks.arena is not None
        self._arena = conn.blocks.arena
        self._slots = info["slots"]
        # int64 words as a memoryview: its item access is a fraction of numpy's scalar indexing
        self._board = self._arena.buffer(info["board"], 8 * board_words(len(self._slots))).cast("q")
        self._recipe = _view_recipe(layout, [segment for _, segment in placed])
        # per slot: its bytes (the memoryview pins the mapping while an anchor lives), the
        # callback that returns it, the weakref to its current batch's anchor
        self._regions = [self._arena.buffer(offset, nbytes) for offset, nbytes in self._slots]
        self._returns = [functools.partial(self._returned, slot) for slot in range(len(self._slots))]
        self._anchors: list[weakref.ref | None] = [None] * len(self._slots)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(10.0)
            sock.connect(info["address"])
            sock.sendall(info["token"])
            _set_kernel_timeout(sock, max(0.05, conn.session.heartbeat_seconds))
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._inbox = bytearray(1 << 12)  # received bytes [_start, _end): no allocation per recv
        self._start = self._end = 0
        self._pending: collections.deque[int] = collections.deque()  # slots to give back
        self._send_lock = threading.Lock()
        self._outstanding = 0  # slots handed to the program and not yet given back
        self._closed = False
        self._ended = False
        self._failure = ""  # why the feed ended early (a pipeline error, a stop): raised again
        # run at each timeout of a wait for a batch: slots of batches dropped meanwhile go back
        # (their anchors die only once JAX's deferred releases run), the ring may wait on one
        self.waiting: Callable[[], None] = self.poll

    def views(self, slot: int) -> dict[str, list[np.ndarray]]:
        """A received slot's per-device views by field (`placed` order), over a new anchor
        whose death returns the slot."""
        anchor = np.frombuffer(self._regions[slot], np.uint8)  # its base: a memoryview, no array
        self._anchors[slot] = weakref.ref(anchor, self._returns[slot])
        return _slot_views(self._recipe, anchor)

    def _returned(self, slot: int, _anchor: weakref.ref) -> None:
        """A slot's anchor died (a weakref callback: any thread, must not block)."""
        self.give_back(slot)

    def poll(self) -> None:
        """Gives back the slots whose batches died (run after JAX's deferred releases)."""
        if self._pending:
            self.flush()

    def flush(self) -> None:
        """Gives the pending slots back on the ring's board; signals the sidecar only if its
        ring waits for a slot and this end holds fewer than `AHEAD` of its batches unread, or
        once closed (its pipeline is stopped: nothing else looks). A host that far ahead needs
        no wake-up (each costs both processes a context switch): the pump's periodic look at
        the board finds the slots, as it does when a flag read too early (no fence orders it
        after the counters, see `shm.ring`) loses the signal."""
        pending, board = self._pending, self._board
        while pending and self._send_lock.acquire(False):
            try:
                while pending:
                    board[1 + pending.popleft()] += 1
                    self._outstanding -= 1
                store_load_hint()  # best effort: see "Ordering" in shm/ring.py
                closed = self._closed
                if closed or (board[WAITING] and self._end - self._start < AHEAD * HEADER):
                    try:
                        self._sock.sendall(b"\x01")
                    except OSError:
                        pass  # the sidecar is gone: its slots went with it
                if closed and self._outstanding == 0:
                    self._sock.close()
                    _LENDING.discard(self)
            finally:
                self._send_lock.release()

    def close(self) -> None:
        """Stops polling: the slots still held come back as their anchors die (callbacks)."""
        if self._closed:
            return
        self.poll()
        self.waiting = self.poll  # the iterator's hook goes: nothing waits any more
        self._regions = []  # live anchors keep their own
        self._closed = True
        with self._send_lock:
            if self._outstanding == 0:
                self._sock.close()
            else:
                _LENDING.add(self)  # the anchors' callbacks need the feed (and its socket)
        self.flush()

    def receive(self, k: int) -> int | None:
        """The slot of batch k, lent to this end from now on (`views` or `give_back` it), or
        None at the end of the data.

        A batch's message is a bare header (`FEED_HEADER`, no tail), read here directly: this
        runs once per batch, right after the trainer wakes with cold caches, where each line
        costs about a microsecond. The last message (a tail) goes through `_last`."""
        if self._ended:
            if self._failure:
                raise PipelineError(self._failure)
            return None
        if self._end - self._start < HEADER:
            self._fill(HEADER)
        with sigint_held():  # taken whole or not at all: an interrupted next() knows which
            start = self._start
            tail, got, slot, _ = FEED_HEADER.unpack_from(self._inbox, start)
            if not tail:
                self._start = start = start + HEADER
                if start == self._end:
                    self._start = self._end = 0
                self._outstanding += 1  # no lock: only `flush` after `close` runs in other threads
        if tail:
            self._last()
            return None
        self._conn.session.alive_at = time.monotonic()  # spares a keepalive (see `Session`)
        if got != k:
            raise RuntimeError(f"{self.host.name} fed batch {got}, expected {k}")
        return slot

    def _last(self) -> None:
        """Reads the last message (see `FeedMessage`): the end of the data, or why there is no
        more, which every later `receive` raises again (never taken for the end)."""
        while not isinstance(message := FeedMessage.read(self._inbox, self._start, self._end), FeedMessage):
            self._fill(message)
        self._ended = True
        tail = message.tail or ("end",)
        if tail[0] == "error":
            self._failure = tail[1]
        elif tail[0] == "stopped":
            self._failure = (
                f"the pipeline on {self.host.name} was stopped on its sidecar before its data's end"
            )
        if self._failure:
            raise PipelineError(self._failure)

    def _fill(self, need: int) -> None:
        """Receives until the inbox holds `need` bytes after `_start` (moving them to the
        front, or growing the inbox, when they would not fit); raises if the host is lost or
        the pipeline closed its feed."""
        inbox, start = self._inbox, self._start
        if start + need > len(inbox):
            del inbox[:start]
            self._end -= start
            self._start = 0
            if need > len(inbox):
                inbox.extend(bytes(need - len(inbox)))
        session = self._conn.session
        while self._end - self._start < need:
            try:
                with memoryview(inbox) as free:
                    got = self._sock.recv_into(free[self._end :])
            except BlockingIOError:  # the kernel's timeout (`_set_kernel_timeout`)
                session.check_alive()  # lost, or its session ended from elsewhere
                self.waiting()
                continue
            except OSError as e:
                got = 0
                if self._closed:
                    raise PipelineError(f"the batch feed of {self.host.name} is closed") from e
            if not got:
                session.heartbeat()  # a dead sidecar: find out now, not at the next heartbeat
                if session.lost is not None:
                    raise HostLostError(str(session.lost))
                raise PipelineError(f"the pipeline on {self.host.name} closed its batch feed")
            self._end += got

    def give_back(self, slot: int) -> None:
        """Queues a received slot that nothing reads any more (its anchor died, or its views
        were never made): `poll()` sends it, or this call once the feed is closed (nobody
        polls any more). Any thread; it must not block."""
        self._pending.append(slot)
        if self._closed:
            self.flush()


_Block = tuple[tuple[int, ...], np.dtype, int, tuple[int, ...]]  # np.ndarray's shape, dtype, offset, strides
_Recipe = list[tuple[str, list[_Block], list[int] | None]]


def _view_recipe(layout: SlotLayout, placed: list[int]) -> _Recipe:
    """Per field: arrays over the slot whose first axis runs over the layout's segments
    (iterating one yields each segment's view: ~0.2 us a view, ~0.5 with `np.ndarray`), and
    which of those views the placed devices take, in order (None: all of them, as they come).
    Segments of equal rows, evenly spaced (the usual case), are one strided array a field."""
    recipe = []
    for name, (shape, dtype) in layout.fields.items():
        dt = np.dtype(dtype)
        strides = [dt.itemsize]  # C order: a row, then each axis of a row
        for d in reversed(shape):
            strides.insert(0, strides[0] * int(d))
        offsets, segments = layout.offsets[name], layout.segments
        rows = {b - a for a, b in segments}
        steps = {b - a for a, b in zip(offsets, offsets[1:], strict=False)}
        blocks: list[_Block]
        if len(rows) == 1 and len(steps) <= 1:
            shape_all = (len(segments), rows.pop(), *shape)
            blocks = [(shape_all, dt, offsets[0], (steps.pop() if steps else 0, *strides))]
        else:
            blocks = [
                ((1, b - a, *shape), dt, offsets[i], (0, *strides)) for i, (a, b) in enumerate(segments)
            ]
        recipe.append((name, blocks, None if placed == list(range(len(segments))) else placed))
    return recipe


def _slot_views(recipe: _Recipe, anchor: np.ndarray) -> dict[str, list[np.ndarray]]:
    """Each field's per-device views of the slot (`placed` order), all based on `anchor`."""
    by_field = {}
    new = np.ndarray
    for name, blocks, picks in recipe:
        views = [
            v for shape, dtype, start, strides in blocks for v in new(shape, dtype, anchor, start, strides)
        ]
        by_field[name] = views if picks is None else [views[i] for i in picks]
    return by_field


def _set_kernel_timeout(sock: socket.socket, seconds: float) -> None:
    """Makes `sock` blocking with the timeout kept by the kernel (`SO_RCVTIMEO`/`SO_SNDTIMEO`;
    a call that runs out raises `BlockingIOError`). Python's own timeout polls before every
    `recv`: two system calls for each message instead of one."""
    sock.settimeout(None)
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def open_feed(obj: Any, host: Host, layout: SlotLayout, placed: list[tuple[Any, int]]) -> Feed | None:
    """A feed to the host's pipeline when this process maps its arena, else None (calls)."""
    conn = host.connection
    if conn.blocks.arena is None:
        return None
    info = obj.open_feed()
    if info is None or info["nonce"] != conn.blocks.arena.nonce:
        return None
    try:
        return Feed(host, info, layout, placed)
    except OSError:
        return None  # another network namespace: the sidecar gives up on it after a while
