"""A sidecar whose Python is busy holding its GIL is not a lost host; a stopped or hung one is.

A long C call that keeps the GIL (here libc's `sleep` through `ctypes.PyDLL`; in production a
shipped function's C extension, or the first import of one, a second or more on a busy machine)
stops every Python thread of the sidecar, its keepalive answers included. The session then probes the process
with a new connection, which gRPC's core answers without the GIL: it passes, and the host is
waited for. A SIGSTOPped sidecar fails the probe and is lost as before; one silent for
`hung_seconds` though it accepts connections is taken for hung.
"""

from __future__ import annotations

import os
import signal
import threading

from failures_helpers import DEADLINE, in_thread
from helpers import wait_for

import colocar

HOLD = 4.0  # seconds: longer than a keepalive waits (2 s at a 0.5 s heartbeat)


@colocar.colocated
def hold_the_gil(seconds):
    """Runs in the sidecar's own process: a C call that does not release the GIL."""
    import ctypes

    ctypes.PyDLL(None).sleep(int(seconds))
    return os.getpid()


def _watch_lost(session) -> tuple[threading.Event, list[str]]:
    """A thread that records the session's loss, if any, until the returned event is set."""
    stop, seen = threading.Event(), []

    def watch() -> None:
        while not stop.wait(0.02):
            if session.lost is not None:
                seen.append(str(session.lost))
                return

    threading.Thread(target=watch, daemon=True).start()
    return stop, seen


def test_a_sidecar_holding_its_gil_is_not_lost_but_a_stopped_one_is(make_cluster):
    c = make_cluster(processes=0, heartbeat_seconds=0.5, lease_seconds=10)
    host, process = c.hosts[0], c.processes[0]
    session = host.connection.session
    generation = session.generation
    stop, seen = _watch_lost(session)
    pid, error = in_thread(lambda: hold_the_gil.on(host)(HOLD))  # the call itself waits on the link
    stop.set()
    assert error is None, f"the busy sidecar's own call failed: {error!r}"  # was: HostLostError
    assert pid == process.pid
    assert not seen, f"a busy sidecar was taken for lost: {seen}"
    assert session.busy_spells >= 1  # its keepalives did go unanswered meanwhile
    assert session.generation == generation  # no reconnect: the session went on
    assert hold_the_gil.on(host)(0) == process.pid
    os.kill(process.pid, signal.SIGSTOP)  # stopped: it fails the probe too
    try:
        wait_for(lambda: session.lost is not None, "the stopped sidecar to be lost", DEADLINE)
    finally:
        os.kill(process.pid, signal.SIGCONT)
        process.kill()
    assert "accepts no connection" in str(session.lost)


def test_a_sidecar_silent_past_hung_seconds_is_lost_though_it_accepts_connections(make_cluster):
    c = make_cluster(processes=0, heartbeat_seconds=0.5, lease_seconds=10)
    host, process = c.hosts[0], c.processes[0]
    session = host.connection.session
    session.hung_seconds = 3.0  # (10 keepalive waits by default: 20 s here)
    future = hold_the_gil.on(host).submit(8)
    try:
        wait_for(lambda: session.lost is not None, "the hung sidecar to be lost", DEADLINE)
        assert "hung" in str(session.lost), str(session.lost)
        assert isinstance(future.exception(timeout=DEADLINE), colocar.HostLostError)
    finally:
        process.kill()
