"""A reconnect replaces the local link; calls on the link it replaced never see a closed socket.

A session reconnects when its sidecar answers again after the host was marked lost (or after
a restart). The new session gets a new link and the old one is retired: a call in flight on it
completes there, and a thread's idle socket on it is closed only while no call uses it, so a
late call on the old link gets a clean error and the thread's next call takes the new link.
Before, the old link's sockets were closed under the calls in flight: they failed (EBADF under
load, or a read of a descriptor number already reused by another socket).
"""

from __future__ import annotations

import os
import time

import pytest
from failures_helpers import DEADLINE
from helpers import wait_for

import colocar
from colocar.protocol import colocar_pb2 as pb
from colocar.protocol.status import Status, TransportError


@colocar.colocated
def nap(marker, seconds):
    """Runs in the sidecar: says it started (creates `marker`), then sleeps."""
    open(marker, "w").close()
    time.sleep(seconds)
    return "slept"


@colocar.colocated
def pid():
    return os.getpid()


def _reconnect(conn) -> None:
    """Marks the session lost (as a false loss would) and lets a heartbeat reconnect it."""
    old = conn.transport.link
    conn.session.mark_lost("marked lost by the test")
    conn.session.heartbeat()
    assert conn.session.lost is None
    assert conn.transport.link is not None and conn.transport.link is not old


def test_a_call_in_flight_on_a_replaced_link_completes(make_cluster, tmp_path):
    c = make_cluster(processes=0, lease_seconds=10)
    host, conn = c.hosts[0], c.hosts[0].connection
    assert conn.transport.link is not None
    marker = str(tmp_path / "started")
    future = nap.on(host).submit(marker, 1.5)
    wait_for(lambda: os.path.exists(marker), "the call to start in the sidecar")
    generation = conn.session.generation
    _reconnect(conn)
    assert conn.session.generation == generation + 1
    assert future.result(timeout=DEADLINE) == "slept"  # was: HostLostError ("local link broke")
    assert pid.on(host)() == c.processes[0].pid


def test_a_late_call_on_a_replaced_link_fails_cleanly_and_the_next_takes_the_new_one(make_cluster):
    c = make_cluster(processes=0, lease_seconds=10)
    host, conn = c.hosts[0], c.hosts[0].connection
    assert pid.on(host)() == c.processes[0].pid  # this thread now has an idle socket on the link
    old = conn.transport.link
    _reconnect(conn)
    with pytest.raises(TransportError) as failed:  # (a thread that took the link just before)
        old.send("Stats", pb.Empty().SerializeToString(), pb.StatsReply, 5).wait()
    assert failed.value.status == Status.UNAVAILABLE
    assert "Bad file descriptor" not in failed.value.details, failed.value.details
    assert failed.value.details == "the local link is closed"
    assert pid.on(host)() == c.processes[0].pid  # over the new link
    assert conn.transport.call("Stats", pb.Empty(), 5).sessions >= 1
