"""A ring of reusable arena slots: producers fill a free slot, consumers lease it, it comes back.

Runs in the sidecar. The ring holds one lease on each slot's block for its whole life. A slot
handed out by `acquire` is being written; once `publish`ed, an exact numpy view of it goes to
the consumer (returning it from a shipped function shares the block, no copy), which adds
leases of its own. The slot is free again when the ring's lease is the only one left: the
consumer dropped every array built on it (also arrays that alias it, such as a `jax.Array`
made by `device_put` on CPU). Blocks are allocated once and reused, never re-faulted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from .allocator import Allocator, Block

_ids = iter(range(1, 1 << 62))


class RingStarvedError(TimeoutError):
    """No slot came free in time: the consumer holds on to every batch of the ring."""


class SlotRing:
    FREE, WRITING, PUBLISHED = "free", "writing", "published"

    def __init__(
        self,
        allocator: Allocator,
        make_view: Callable[[Block, tuple[int, ...], np.dtype], np.ndarray],
        slots: int,
        nbytes: int,
        *,
        pool: str = "default",
        timeout: float = 0.0,
    ):
        self._allocator = allocator
        self._make_view = make_view
        self._owner = f"ring:{next(_ids)}"
        self.blocks: list[Block] = []
        try:
            for _ in range(slots):
                self.blocks.append(allocator.allocate(nbytes, owner=self._owner, pool=pool, timeout=timeout))
        except BaseException:
            allocator.release_owner(self._owner)
            raise
        self._state = [self.FREE] * slots
        self._lock = threading.Lock()
        self._closed = False

    def __len__(self) -> int:
        return len(self.blocks)

    def _reclaim(self) -> None:
        for i, block in enumerate(self.blocks):
            if self._state[i] == self.PUBLISHED and self._allocator.leases(block.id) == 1:
                self._state[i] = self.FREE

    def acquire(self, timeout: float) -> int:
        """A free slot's index, now WRITING; waits up to `timeout` seconds for one to come back
        (woken by the allocator when a consumer drops a lease, or by `abandon`)."""
        deadline = time.monotonic() + timeout
        while True:
            seen = self._allocator.releases()
            with self._lock:
                if self._closed:
                    raise RuntimeError("the ring is closed")
                self._reclaim()
                for i, state in enumerate(self._state):
                    if state == self.FREE:
                        self._state[i] = self.WRITING
                        return i
            if time.monotonic() > deadline:
                raise RingStarvedError(
                    f"no free slot among {len(self)} for {timeout:.0f} s: the consumer still holds "
                    "every batch of the ring (keep fewer batches alive, or raise prefetch)"
                )
            self._allocator.wait_for_release(seen, max(0.0, deadline - time.monotonic()))

    def publish(self, i: int) -> np.ndarray:
        """An exact uint8 view of slot i for the consumer; the slot stays leased while it lives."""
        block = self.blocks[i]
        with self._lock:
            view = self._make_view(block, (block.nbytes,), np.dtype(np.uint8))
            self._state[i] = self.PUBLISHED
        return view

    def abandon(self, i: int) -> None:
        """Gives back a slot that was acquired but will not be published."""
        with self._lock:
            self._state[i] = self.FREE
        self._allocator.wake_waiters()

    def in_use(self) -> int:
        """Slots being written or still held by a consumer."""
        with self._lock:
            self._reclaim()
            return sum(state != self.FREE for state in self._state)

    def close(self) -> None:
        """Drops the ring's leases; each block is freed once its consumers let go too."""
        with self._lock:
            self._closed = True
        self._allocator.release_owner(self._owner)
