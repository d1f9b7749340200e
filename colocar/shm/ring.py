"""A ring of reusable arena slots: producers fill a free slot, consumers lease it, it comes back.

Runs in the sidecar. The ring holds one lease on each slot's block for its whole life. A slot
handed out by `try_acquire` is being written; once `publish`ed, an exact numpy view of it goes to
the consumer (returning it from a shipped function shares the block, no copy), which adds
leases of its own. The slot is free again when the ring's lease is the only one left: the
consumer dropped every array built on it (also arrays that alias it, such as a `jax.Array`
made by `device_put` on CPU). Blocks are allocated once and reused, never re-faulted. A user
that found no free slot waits on the allocator's release listeners (`add_release_listener`),
which fire when a consumer drops a lease or the ring is `nudge`d.

A consumer in another process that maps the arena can instead borrow slots (`lend`) and give
them back through the ring's **board**, a few int64 words in the arena: it bumps the slot's
word, and signals the ring (`reclaim_lent`) only while its user waits for a slot, which the
board's first word says. A batch then costs the consumer no message at all while the ring has free slots.

Ordering. The board is plain int64 words in shared memory, read and written by two processes
with no fence between them (Python has none that is portable): each word has one writer (the
flag: the ring; word 1 + i: the borrower) and aligned 8-byte stores and loads are atomic on
x86-64 and AArch64, but a store may become visible to the other process after a later load.
The protocol is correct in any order:

* A slot is never reused early. The ring frees a lent slot only when it reads the slot's
  counter at or above the number of times it lent it; the borrower bumps the counter only
  after it let go of the slot (its reads of the slot are over by then: JAX frees a buffer only
  after the computations reading it signalled completion, through its own locks, which order
  those reads before what follows). A counter never runs ahead of the slot's returns, so a late
  or early view of any word can only delay the slot, never free it while the borrower reads it.
* A returned slot is never lost for good. The flag handshake (ring: raise the flag, then look
  at the counters; borrower: bump a counter, then read the flag) is the store-then-load pattern
  that needs a store-load fence: without one both sides may read the old values, and the
  borrower gives the slot back without signalling while the ring, having looked, waits. The
  ring's user therefore must look again while it waits (`try_acquire` at least every few
  milliseconds: the loaders' pump does every `RECHECK_SECONDS`), so a lost signal costs one
  such delay. A stale flag read as raised costs one needless signal.

`store_load_hint` narrows the window where it can: on x86 acquiring a lock is a locked
instruction, a full barrier, so no signal is lost there; elsewhere (ARM: GH200/Grace, Axion)
it promises nothing, and nothing depends on it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from .allocator import Allocator, Block

_ids = iter(range(1, 1 << 62))

WAITING = 0  # board word: 1 while the user waits for a slot; then word 1 + i counts slot i's returns
_HINT = threading.Lock()


def store_load_hint() -> None:
    """Best effort, between a board store and a board load: a full barrier on x86 (a lock's
    acquire is a locked instruction), no promise elsewhere. See "Ordering" above: the
    protocol's correctness does not depend on it."""
    with _HINT:
        pass


def board_words(slots: int) -> int:
    return 1 + slots


class RingStarvedError(TimeoutError):
    """No slot came free in time: the consumer holds on to every batch of the ring."""


class SlotRing:
    FREE, WRITING, PUBLISHED, LENT = "free", "writing", "published", "lent"

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
            board = allocator.allocate(8 * board_words(slots), owner=self._owner, pool=pool, timeout=timeout)
        except BaseException:
            allocator.release_owner(self._owner)
            raise
        self.board_block = board
        self._board = make_view(board, (board_words(slots),), np.dtype(np.int64))
        self._board[:] = 0
        self._lender = f"{self._owner}:lent"  # a lent slot's own lease: it outlives `close`
        self._lent = [0] * slots  # times each slot was lent
        self._borrower_gone = False
        self._state = [self.FREE] * slots
        self._lock = threading.Lock()
        self._closed = False

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def allocator(self) -> Allocator:
        return self._allocator

    def _reclaim(self) -> None:
        """Lock held: slots whose consumers let go become free."""
        board = self._board
        for i, block in enumerate(self.blocks):
            state = self._state[i]
            if state == self.PUBLISHED and self._allocator.leases(block.id) == 1:
                self._state[i] = self.FREE
            elif state == self.LENT and board[1 + i] >= self._lent[i]:
                self._state[i] = self.FREE
                self._allocator.release(block.id, self._lender)

    def _take_free(self) -> int | None:
        """Lock held: a free slot, now WRITING, or None."""
        self._reclaim()
        for i, state in enumerate(self._state):
            if state == self.FREE:
                self._state[i] = self.WRITING
                return i
        return None

    def try_acquire(self, urgent: bool = True) -> int | None:
        """A free slot's index, now WRITING, or None.

        Not `urgent` (the caller still has work queued): a borrower gives slots back on the
        board without signalling, and the caller looks again when it likes. Urgent and none
        free: the board asks the borrower to signal (`reclaim_lent`) each slot it gives back;
        a signal can still be lost (see "Ordering"), so a caller that waits calls again
        within a bounded time, which finds the slot.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("the ring is closed")
            i = self._take_free()
            if i is None and urgent:  # from now on a borrower that gives a slot back signals
                self._board[WAITING] = 1
                store_load_hint()
                i = self._take_free()  # ...so look again for one given back before
            if i is not None:
                self._board[WAITING] = 0
            return i

    def starved(self, seconds: float) -> RingStarvedError:
        """The error for a wait of `seconds` with no slot given back."""
        self._board[WAITING] = 0
        return RingStarvedError(
            f"no free slot among {len(self)} for {seconds:.0f} s: the consumer still holds "
            "every batch of the ring (keep fewer batches alive, or raise prefetch)"
        )

    def publish(self, i: int) -> np.ndarray:
        """An exact uint8 view of slot i for the consumer; the slot stays leased while it lives."""
        block = self.blocks[i]
        with self._lock:
            view = self._make_view(block, (block.nbytes,), np.dtype(np.uint8))
            self._state[i] = self.PUBLISHED
        return view

    def lend(self, i: int) -> bool:
        """Hands slot i to a borrower that maps the arena: it stays leased until the borrower
        bumps board word 1 + i (`reclaim_lent` or the next `try_acquire` sees it) or `return_lent`.
        False (nothing lent) once the ring is closed or the borrower is gone."""
        with self._lock:
            if self._closed or self._borrower_gone:
                return False
            self._allocator.acquire(self.blocks[i].id, self._lender)
            self._lent[i] += 1
            self._state[i] = self.LENT
            return True

    def reclaim_lent(self) -> None:
        """Frees the lent slots the board says were given back (a borrower's signal)."""
        with self._lock:
            self._reclaim()
        self.nudge()

    def return_lent(self) -> None:
        """Frees every lent slot, and lends no more: the borrower is gone (its mapping too)."""
        with self._lock:
            self._borrower_gone = True
            for i, state in enumerate(self._state):
                if state == self.LENT:
                    self._state[i] = self.FREE
            self._allocator.release_owner(self._lender)

    def abandon(self, i: int) -> None:
        """Gives back a slot that was acquired but will not be published."""
        with self._lock:
            self._state[i] = self.FREE
        self.nudge()

    def nudge(self) -> None:
        """Tells the allocator's release listeners (a waiting user) to look at the ring again."""
        self._allocator.notify_release_listeners()

    def in_use(self) -> int:
        """Slots being written or still held by a consumer."""
        with self._lock:
            self._reclaim()
            return sum(state != self.FREE for state in self._state)

    def close(self) -> None:
        """Drops the ring's leases; each block is freed once its consumers let go too."""
        with self._lock:
            self._closed = True
            self._reclaim()
        self._allocator.release_owner(self._owner)
