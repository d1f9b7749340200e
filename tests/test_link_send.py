"""A request larger than a socket's buffer, sent while the sidecar does not read.

A function's code travels with its first call on the local link (a closure over a table can
make it megabytes). The sidecar may stop reading for a while (its interpreter busy, the
process stopped): the send then waits as a reply's wait does, in poll slices while the host is
alive, instead of failing after one slice with half a request sent. A Ctrl-C during that send
retires the socket (the sidecar never runs half a request) and the next call gets its own reply.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading

import pytest
from helpers import sigstop
from interrupts_helpers import DEADLINE, ident, run_interrupted, settled, use_at_rest

import colocar

TABLE_BYTES = 4 << 20  # far over a Unix socket's buffer (~200 KiB)


def _digest_of_table(table: bytes, marker: str | None = None):
    """A colocated function whose code carries `table` (its first call's request is that big);
    it creates `marker` when it runs."""

    def digest() -> str:
        if marker is not None:
            open(marker, "w").close()
        return hashlib.sha256(table).hexdigest()

    return colocar.colocated(digest)


def _stop(host, sidecar) -> None:
    """SIGSTOP, once it took effect, with an idle socket to the sidecar (a call's new socket
    would wait for its greeting, not in the send)."""
    assert ident.on(host)(0) == 0
    sigstop(sidecar.pid)


def test_a_big_request_waits_out_a_sidecar_that_stops_reading(make_cluster):
    """Before, the send failed after one poll slice: a call without a deadline timed out."""
    cluster = make_cluster(hosts=1, processes=0, heartbeat_seconds=1.0)
    host, sidecar = cluster.hosts[0], cluster.processes[0]
    table = os.urandom(TABLE_BYTES)
    remote = _digest_of_table(table)
    stalled = 2.5 * host.connection.session.heartbeat_seconds  # slices of the send; not yet a lost host
    _stop(host, sidecar)
    threading.Timer(stalled, sidecar.send_signal, (signal.SIGCONT,)).start()
    assert remote.on(host)() == hashlib.sha256(table).hexdigest()


@pytest.mark.timeout(120)
def test_ctrl_c_while_a_request_is_sent_never_runs_it_and_the_next_call_gets_its_own_reply(
    make_cluster, tmp_path
):
    cluster = make_cluster(hosts=1, processes=0)
    host, sidecar = cluster.hosts[0], cluster.processes[0]
    marker = str(tmp_path / "ran")
    remote = _digest_of_table(os.urandom(TABLE_BYTES), marker)
    baseline = use_at_rest(cluster)
    _stop(host, sidecar)  # reads nothing: the send stops once the buffer is full
    try:
        interrupted, _ = run_interrupted(lambda: remote.on(host).submit(), 0.3)
    finally:
        sidecar.send_signal(signal.SIGCONT)
    assert interrupted
    assert ident.on(host)(1) == 1
    assert ident.on(host).submit(2).result(DEADLINE) == 2
    settled(cluster, baseline)
    assert not os.path.exists(marker)  # half a request never runs
