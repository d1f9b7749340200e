"""A future's reply over the local link is read by the thread that waits for it.

`submit()` sends the call at once; `result()` reads the reply in the waiting thread, with no
thread in between (`result(timeout)` too, up to its limit). A reply nobody waits for that way
(a callback, `done()`, a call queued behind it, a dropped future) is read in the background
instead: each test here would hang, or get another call's value, if one of those were left
unread or read twice.
"""

from __future__ import annotations

import array
import fcntl
import gc
import signal
import socket
import termios
import threading
from typing import Any

import numpy as np
import pytest
from helpers import sigstop, wait_for
from interrupts_helpers import DEADLINE, ident, settled, use_at_rest, wait_for_file

import colocar


def _readers_started(c: Any) -> bool:
    """Whether any of the cluster's hosts started its background readers (its link's pool of
    threads, made at the first reply that nobody waits for inline)."""
    return any(h.connection.transport._pool is not None for h in c.hosts)


@colocar.colocated
def doubled(x):
    return x * 2


def test_futures_are_read_by_their_waiters_with_no_thread_in_between(make_cluster):
    """Futures on both hosts at once, waited for out of order, each get their own value, and
    the controller starts no reader thread; a callback (nobody waits inline) starts one."""
    c = make_cluster(hosts=2, processes=0)
    values = [np.arange(1000, dtype=np.int64) + i for i in range(6)]
    for i in range(30):  # one call in flight per host (more would queue behind it)
        futures = [doubled.on(h).submit(values[(i + k) % 6]) for k, h in enumerate(c.hosts)]
        for k, future in reversed(list(enumerate(futures))):
            value = future.result(timeout=DEADLINE) if i % 2 else future.result()  # a bounded wait too
            np.testing.assert_array_equal(value, values[(i + k) % 6] * 2)
    assert not _readers_started(c)
    called = threading.Event()
    doubled.on(c.hosts[0]).submit(values[0]).add_done_callback(lambda _: called.set())
    assert called.wait(DEADLINE)
    assert _readers_started(c)


@pytest.mark.timeout(DEADLINE)  # a reply left unread hangs `result()`: the test fails instead
def test_a_call_queued_behind_an_unread_future_gets_its_own_reply(cluster, tmp_path):
    """The first future's reply is read in the background once a second call queues behind
    it, so waiting for the second (before or without reading the first) never hangs."""
    host = cluster.hosts[0]
    stop = tmp_path / "stop"
    first = wait_for_file.on(host).submit(str(stop))
    second = ident.on(host).submit("second")
    stop.touch()
    assert second.result() == "second"  # no limit: the inline read
    assert ident.on(host)("third") == "third"  # a sync call on the same lane
    assert first.result() == "wait_for_file(stop) result"


@pytest.mark.timeout(DEADLINE)
def test_a_bounded_wait_that_times_out_leaves_the_call_to_a_later_wait(cluster, tmp_path):
    host = cluster.hosts[0]
    stop = tmp_path / "stop"
    future = wait_for_file.on(host).submit(str(stop))
    with pytest.raises(TimeoutError):
        future.result(timeout=0.05)
    stop.touch()
    assert future.result(timeout=DEADLINE) == "wait_for_file(stop) result"
    assert ident.on(host)("next") == "next"  # its own reply, on the same lane


REPLY_BYTES = 900_000  # over a Unix socket's buffer (~200 KiB), under a pickle sent in the reply (1 MiB)


@colocar.colocated
def random_bytes(n, seed):
    return np.random.default_rng(seed).bytes(n)


def _queued(sock: socket.socket) -> int:
    """Bytes waiting in a socket's receive queue."""
    count = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.FIONREAD, count)
    return count[0]


@pytest.mark.timeout(120)
def test_a_bounded_wait_that_ends_mid_reply_leaves_the_rest_to_a_later_wait(make_cluster):
    """The waiting thread reads the reply until its limit; one that passes with half the reply
    read (the sidecar stopped as it sent) raises TimeoutError, and the rest is read on from
    there: a later wait gets the whole value, and the lane's next call its own. A stop that
    came after the whole reply was sent (once in ~15 suites) gives the value at once: that try
    is checked and made again, and the case must come up in one of three."""
    c = make_cluster(hosts=1, processes=0, heartbeat_seconds=1.0)  # a short stop is no loss
    host, sidecar = c.hosts[0], c.processes[0]
    outcomes = []
    for seed in range(3):
        outcomes.append(_stop_mid_reply(host, sidecar, seed))
        if outcomes[-1] == "mid-reply":
            break
    assert outcomes[-1] == "mid-reply", outcomes
    assert ident.on(host)("next") == "next"


def _stop_mid_reply(host, sidecar, seed: int) -> str:
    """One try: "mid-reply" when the bounded wait ended with part of the reply read, "whole"
    when the reply was all there; the value must be right either way."""
    future = random_bytes.on(host).submit(REPLY_BYTES, seed)
    pending = future._call._future.reader._pending  # the reply's socket and what was read of it
    wait_for(lambda: _queued(pending._sock) > 100_000, "the reply to fill the socket's buffer")
    outcome = "whole"
    try:
        sigstop(sidecar.pid)
        try:
            value = future.result(timeout=0.2)
        except TimeoutError:
            frame = pending._frame
            assert frame.buffer is not None and 0 < frame.taken < len(frame.buffer)  # mid-reply
            outcome = "mid-reply"
    finally:
        sidecar.send_signal(signal.SIGCONT)
    if outcome == "mid-reply":
        value = future.result(timeout=DEADLINE)
    assert value == np.random.default_rng(seed).bytes(REPLY_BYTES)
    return outcome


def test_a_dropped_unread_future_frees_its_lane_and_its_reply(cluster):
    """A future dropped before its reply was read: the next call on its lane goes, and the
    arena blocks its reply held go back."""
    host = cluster.hosts[0]
    baseline = use_at_rest(cluster)
    future = doubled.on(host).submit(np.ones(1 << 16, dtype=np.float32))
    del future
    gc.collect()
    assert ident.on(host)("next") == "next"
    settled(cluster, baseline)


def test_done_and_callbacks_see_an_unread_future_complete(cluster):
    host = cluster.hosts[0]
    future = ident.on(host).submit("polled")
    wait_for(future.done, "the polled future to complete")
    assert future.result() == "polled"


@pytest.mark.timeout(DEADLINE)
def test_a_future_sent_again_with_its_code_is_read_inline(make_cluster):
    """A sidecar that lacks the code answers NOT_FOUND; the call goes again with the code,
    and the waiting thread reads the second reply."""

    @colocar.colocated
    def tripled(x):
        return x * 3

    c = make_cluster(hosts=1, processes=0)
    host = c.hosts[0]
    code_hash, _ = tripled._code.pickled()
    host.connection.session.known_code.add(code_hash)  # as after the sidecar forgot it
    assert tripled.on(host).submit(7).result() == 21
    assert tripled.on(host).submit(5).result() == 15


@colocar.colocated
def nothing():
    return None


def test_calls_leave_no_garbage_cycles(cluster):
    """A call's objects are freed as it ends, not by the garbage collector: each call that left
    a cycle (its future and its reply's reader, holding each other) made the collector run
    every few dozen calls, and a full collection of the controller's heap paused it for tens of
    milliseconds. Futures, calls on several hosts and array calls, with the collector off."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    host = cluster.hosts[0]
    x = jax.device_put(np.arange(64.0).reshape(8, 8), NamedSharding(cluster.mesh(("data",)), P("data")))
    kinds = {
        "future": lambda: nothing.on(host).submit().result(),
        "hosts": lambda: nothing.on(cluster.hosts)(),
        "array": lambda: jax.block_until_ready(doubled(x)),
    }
    for name, call in kinds.items():
        for _ in range(5):
            call()
        gc.collect()
        gc.disable()
        try:
            for _ in range(50):
                call()
            left = gc.collect()
        finally:
            gc.enable()
        assert left < 50, f"{name}: {left} objects in cycles after 50 calls"
