"""Tests of colocar.shm's slot ring: waiting for the consumer, lending slots over its board, and
a slot given back without a signal.
"""

from __future__ import annotations

import threading

import numpy as np

from colocar.shm import (
    ndarray_view,
)

MiB = 1 << 20


def test_slot_ring_waits_for_its_consumer_and_reuses_slots(shm_dir):
    """A full ring has no slot until a consumer lets go of one (the allocator's release listener
    fires, as the pump waits for it) or one is given back unpublished (`abandon`), and names the
    starvation when nothing comes back."""
    from colocar.shm.ring import RingStarvedError
    from colocar.sidecar.blocks import SidecarArena

    arena = SidecarArena(shm_dir, MiB, label="ringtest")
    ring = arena.ring(2, 4096)
    released = threading.Event()
    arena.allocator.add_release_listener(released.set)
    try:
        first, second = ring.try_acquire(), ring.try_acquire()
        held = ring.publish(first)
        held[:] = 7
        assert ring.try_acquire() is None
        starved = ring.starved(0.2)
        assert isinstance(starved, RingStarvedError) and "no free slot among 2" in str(starved)
        released.clear()
        del held  # the consumer drops the batch: its lease goes, the listener fires
        assert released.wait(60)
        assert ring.try_acquire() == first
        released.clear()
        ring.abandon(second)  # a slot given back without being published
        assert released.wait(60)
        assert ring.try_acquire() == second
    finally:
        arena.allocator.remove_release_listener(released.set)
        ring.close()
        arena.close()


def test_slot_ring_lends_slots_given_back_on_its_board(shm_dir):
    """A borrower gives lent slots back by bumping the board: silently while the ring's user
    has work queued (the next look finds the slot), with a signal once its user waits (the
    board's flag says so). Lent slots outlive `close` until given back; `return_lent` (the
    borrower is gone) frees them all and refuses further lending."""
    from colocar.shm.ring import WAITING, board_words
    from colocar.sidecar.blocks import SidecarArena

    arena = SidecarArena(shm_dir, MiB, label="lendtest")
    ring = arena.ring(2, 4096)
    board = ndarray_view(arena.arena, ring.board_block.offset, (board_words(2),), np.int64)  # the borrower's
    leases = lambda i: arena.allocator.leases(ring.blocks[i].id)  # noqa: E731
    try:
        first, second = ring.try_acquire(), ring.try_acquire()
        assert ring.lend(first) and ring.lend(second)
        board[1 + first] += 1  # given back silently: a look finds it, no signal needed
        assert ring.try_acquire(urgent=False) == first
        assert ring.try_acquire(urgent=False) is None and board[WAITING] == 0  # no signal wanted
        assert ring.try_acquire(urgent=True) is None and board[WAITING] == 1  # now one is

        released = threading.Event()
        arena.allocator.add_release_listener(released.set)
        board[1 + second] += 1
        ring.reclaim_lent()  # the borrower's signal wakes the waiting user
        assert released.wait(60)
        arena.allocator.remove_release_listener(released.set)
        assert ring.try_acquire() == second and board[WAITING] == 0

        assert ring.lend(first)
        ring.close()
        assert (leases(first), leases(second)) == (1, 0)  # the lent slot stays, the other is freed
        board[1 + first] += 1
        ring.reclaim_lent()
        assert leases(first) == 0
        ring.return_lent()
        assert not ring.lend(second)
    finally:
        ring.close()
        arena.close()


def test_slot_ring_finds_a_slot_given_back_without_a_signal_at_its_next_look(shm_dir):
    """The board has no memory fence ("Ordering" in shm/ring.py): a borrower may read the flag
    as down although the ring's user already waits, and give a slot back with no signal. Nothing
    wakes the user then, but its next look (`try_acquire`, which it makes while it waits) finds
    the slot. And a return counts for one lending only: a slot lent again stays lent until the
    borrower bumps its counter again, whatever it did before."""
    from colocar.shm.ring import WAITING, board_words
    from colocar.sidecar.blocks import SidecarArena

    arena = SidecarArena(shm_dir, MiB, label="lostsignal")
    ring = arena.ring(2, 4096)
    board = ndarray_view(arena.arena, ring.board_block.offset, (board_words(2),), np.int64)  # the borrower's
    woken = threading.Event()
    arena.allocator.add_release_listener(woken.set)
    try:
        first, second = ring.try_acquire(), ring.try_acquire()
        assert ring.lend(first) and ring.lend(second)
        assert ring.try_acquire(urgent=True) is None and board[WAITING] == 1  # the user waits
        woken.clear()
        board[1 + second] += 1  # given back; the borrower read the flag as down: no `reclaim_lent`
        assert not woken.wait(0.2)  # nothing tells the user...
        assert ring.try_acquire(urgent=True) == second  # ...its next look finds the slot
        assert board[WAITING] == 0

        assert ring.lend(second)  # lent a second time; the board still counts one return
        assert ring.try_acquire(urgent=True) is None and ring.in_use() == 2
        board[1 + second] += 1
        assert ring.try_acquire(urgent=True) == second
    finally:
        arena.allocator.remove_release_listener(woken.set)
        ring.close()
        ring.return_lent()
        arena.close()
