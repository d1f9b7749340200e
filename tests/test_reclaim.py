"""The deferred releaser: batches in its own thread, and nothing written anywhere after close.

Views' finalizers push into a `Reclaimer` at any time, also after its connection closed. A push
then must not touch a file descriptor: the old pipe-based wake-up wrote one byte to the number
of its closed pipe, which the process had meanwhile given to a new link socket (a stray byte
in a request stream) or an arena file.
"""

from __future__ import annotations

import os
import select
import threading

from helpers import wait_for

from colocar.shm.reclaim import Reclaimer


def test_pushed_items_are_released_in_batches_and_flush_waits_for_them():
    released: list[int] = []
    reclaimer = Reclaimer(released.extend)
    try:
        for i in range(100):
            reclaimer.push(i)
        assert reclaimer.flush(timeout=30)
        assert sorted(released) == list(range(100))
    finally:
        reclaimer.close()


def test_close_releases_what_was_queued():
    released: list[int] = []
    gate = threading.Event()

    def release(batch: list[int]) -> None:
        gate.wait(30)
        released.extend(batch)

    reclaimer = Reclaimer(release)
    reclaimer.push(1)
    reclaimer.push(2)
    gate.set()
    reclaimer.close()
    assert sorted(released) == [1, 2]


def test_a_push_after_close_writes_into_no_reused_descriptor():
    released: list[int] = []
    reclaimer = Reclaimer(released.extend)
    reclaimer.push(1)
    wait_for(lambda: released == [1], "the first release")
    reclaimer.close()
    read_fd, write_fd = os.pipe()  # takes the lowest free numbers, as a new socket would
    try:
        for _ in range(10):
            reclaimer.push(2)  # a view's finalizer after its connection closed
        readable, _, _ = select.select([read_fd], [], [], 0.5)
        assert readable == [], "a push after close wrote into a descriptor it does not own"
        assert released == [1]
    finally:
        os.close(read_fd)
        os.close(write_fd)
