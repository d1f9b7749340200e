"""The controller's end of a host's batch feed (runs in the controller / device owner).

When the controller maps a host's arena, each finished batch arrives as `(batch, slot)` over a
socket of the pipeline's own, and the slot goes back on the ring's board once nothing reads it
any more (see `host_backend` for the sidecar's end); otherwise the iterator falls back to calls.
"""

from __future__ import annotations

import collections
import socket
import sys
import threading
import time
import weakref
from typing import Any

import numpy as np

from colocar.controller_bridge.cluster import Host
from colocar.errors import HostLostError
from colocar.protocol.messages import FeedMessage
from colocar.shm import ndarray_view
from colocar.shm.ring import WAITING, board_words, store_load_hint

from .layout import SlotLayout
from .pump import PipelineError


class _Feed:
    """The controller's end of a host's batch feed (see `host_backend`): batches in, slots back.

    Each slot's per-device views (one per field and device, in `placed` order) are made once
    and reused at every turn of the ring. A slot handed to the program is held while any of its
    views is referenced by more than our cache, i.e. while a batch's arrays (which alias the
    views on CPU) or anything derived from them live: `poll()` (each step, after JAX's deferred
    releases ran) gives back the slots that are free again. This costs a
    reference count per view instead of a fresh view, holder and finalizer per batch.

    At `close()` the slots still held switch to finalizers on their views (and our cache lets
    go of them); the socket stays open until the last one is released, so the sidecar keeps
    every slot a live batch reads.
    """

    def __init__(self, host: Host, info: dict[str, Any], layout: SlotLayout, placed: list[tuple[Any, int]]):
        conn = host.connection
        self.host = host
        self._conn = conn
        assert conn.blocks.arena is not None
        self._arena = conn.blocks.arena
        self._slots = info["slots"]
        self._board = ndarray_view(self._arena, info["board"], (board_words(len(self._slots)),), np.int64)
        self._layout = layout
        self._segments = [segment for _, segment in placed]
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(10.0)
            sock.connect(info["address"])
            sock.sendall(info["token"])
            sock.settimeout(max(0.05, conn.session.heartbeat_seconds))
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._inbox = bytearray(1 << 12)  # received bytes [_start, _end): no allocation per recv
        self._start = self._end = 0
        self._pending: collections.deque[int] = collections.deque()
        self._send_lock = threading.Lock()
        self._outstanding = 0  # slots handed to the program and not yet released
        self._closed = False
        self._ended = False
        # slot -> ({field: views in `placed` order}, all its views, their free reference count)
        self._cache: dict[int, tuple[dict[str, list[np.ndarray]], list[np.ndarray], int]] = {}
        self._held: list[int] = []  # slots handed out and not released, oldest first

    def _views(self, slot: int) -> tuple[dict[str, list[np.ndarray]], list[np.ndarray], int]:
        offset, nbytes = self._slots[slot]
        whole = ndarray_view(self._arena, offset, (nbytes,), np.uint8)  # pins the arena's mapping
        layout = self._layout
        by_field = {
            name: [layout.segment_view(whole, name, segment) for segment in self._segments]
            for name in layout.fields
        }
        views = [v for vs in by_field.values() for v in vs]
        del whole
        entry = (by_field, views, _max_refs(views))
        self._cache[slot] = entry
        return entry

    def poll(self) -> None:
        """Releases the held slots that nothing references any more."""
        held = self._held
        if held:
            cache = self._cache
            free = [slot for slot in held if _max_refs(cache[slot][1]) <= cache[slot][2]]
            if free:
                for slot in free:
                    held.remove(slot)
                self._pending.extend(free)
                self.flush()

    def busy(self) -> bool:
        """True while a slot handed out is still referenced (after a poll)."""
        return bool(self._held)

    def _release(self, slot: int) -> None:
        """A GC finalizer (any thread, must not block): queue, and send if nobody is sending."""
        self._pending.append(slot)
        self.flush()

    def flush(self) -> None:
        """Gives the pending slots back on the ring's board; signals the sidecar only if its
        ring waits for a slot, or once closed (its pipeline is stopped: nothing else looks).
        A flag read too early (no fence orders it after the counters, see `shm.ring`) loses
        the signal; the pump's periodic look at the board finds the slots anyway."""
        while self._pending and self._send_lock.acquire(blocking=False):
            try:
                board, n = self._board, 0
                while self._pending:
                    board[1 + self._pending.popleft()] += 1
                    n += 1
                self._outstanding -= n
                store_load_hint()  # best effort: see "Ordering" in shm/ring.py
                if self._closed or board[WAITING]:
                    try:
                        self._sock.sendall(b"\x01")
                    except OSError:
                        pass  # the sidecar is gone: its slots went with it
                if self._closed and self._outstanding == 0:
                    self._sock.close()
            finally:
                self._send_lock.release()

    def close(self) -> None:
        if self._closed:
            return
        self.poll()
        for slot in self._held:  # still held by the program: released when its views die
            views = self._cache[slot][1]
            left = [len(views)]

            def dropped(slot: int = slot, left: list[int] = left) -> None:
                left[0] -= 1
                if left[0] == 0:
                    self._release(slot)

            for view in views:
                weakref.finalize(view, dropped).atexit = False
        self._held = []
        self._cache.clear()  # the held slots' views now live only as long as the program's arrays
        self._closed = True
        with self._send_lock:
            if self._outstanding == 0:
                self._sock.close()
        self.flush()

    def _message(self) -> FeedMessage | None:
        """The next message (see `protocol.messages.FeedMessage`), or None while none is
        complete (then the inbox has room for the rest of it after `_end`)."""
        inbox, start = self._inbox, self._start
        message = FeedMessage.read(inbox, start, self._end)
        if isinstance(message, FeedMessage):
            self._start = start + message.size
            if self._start == self._end:
                self._start = self._end = 0
            return message
        need = message
        if start + need > len(inbox):  # move the partial message to the front; grow for a long one
            del inbox[:start]
            self._end -= start
            self._start = 0
            if need > len(inbox):
                inbox.extend(bytes(need - len(inbox)))
        return None

    def next_batch(self, k: int) -> tuple[dict[str, list[np.ndarray]], int] | None:
        """Batch k: its per-device views by field (`placed` order) and its count of bad
        records; None at the end of the data."""
        if self._ended:
            return None
        conn = self._conn
        while (message := self._message()) is None:
            try:
                with memoryview(self._inbox) as free:
                    got = self._sock.recv_into(free[self._end :])
            except TimeoutError:
                if conn.session.lost is not None:
                    raise HostLostError(str(conn.session.lost)) from None
                continue
            except OSError as e:
                got = 0
                if self._closed:
                    raise PipelineError(f"the batch feed of {self.host.name} is closed") from e
            if not got:
                conn.session.heartbeat()  # a dead sidecar: find out now, not at the next heartbeat
                if conn.session.lost is not None:
                    raise HostLostError(str(conn.session.lost))
                raise PipelineError(f"the pipeline on {self.host.name} closed its batch feed")
            self._end += got
        conn.session.alive_at = time.monotonic()  # spares a keepalive (see `Session`)
        got, slot, bad, tail, _ = message
        if tail is not None:  # ("end",) or ("error", text)
            self._ended = True
            if tail[0] == "error":
                raise PipelineError(tail[1])
            return None
        if got != k:
            raise RuntimeError(f"{self.host.name} fed batch {got}, expected {k}")
        entry = self._cache.get(slot) or self._views(slot)
        self._outstanding += 1  # no lock: only `flush` after `close` runs in other threads
        self._held.append(slot)
        return entry[0], bad


def _max_refs(views: list[np.ndarray]) -> int:
    return max(map(sys.getrefcount, views), default=0)


def open_feed(obj: Any, host: Host, layout: SlotLayout, placed: list[tuple[Any, int]]) -> _Feed | None:
    """A feed to the host's pipeline when this process maps its arena, else None (calls)."""
    conn = host.connection
    if conn.blocks.arena is None:
        return None
    info = obj.open_feed()
    if info is None or info["nonce"] != conn.blocks.arena.nonce:
        return None
    try:
        return _Feed(host, info, layout, placed)
    except OSError:
        return None  # another network namespace: the sidecar gives up on it after a while
