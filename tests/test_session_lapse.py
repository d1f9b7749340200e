"""A session lapses only when its controller was silent while the sidecar listened, and what a
controller holds never changes when its session lapses and it comes back (`sidecar/sessions.py`,
`sidecar/held_blocks.py`).

A controller that sleeps past its lease (a laptop's lid, SIGSTOP) while holding an array over
its session's blocks has them freed by the lapse; it reconnects under the same session id, and
its new results must not reuse the blocks it still maps (they did: the held array changed). A
sidecar that did not run for longer than a lease (its GIL held by code in its own process, as a
first tensorstore import with `processes=0` does) keeps its sessions: the keepalives of that time
wait unread on their sockets.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import numpy as np
from failures_helpers import Counter
from helpers import program, wait_for

import colocar
from colocar.protocol import colocar_pb2 as pb


@colocar.colocated
def filled(value):
    out = colocar.shm.empty((1 << 16,), np.float32)
    out[:] = value
    return out


@colocar.colocated
def hold_the_gil(seconds: float) -> None:
    """Sleeps in C with the GIL held (ctypes.PyDLL keeps it): no other thread of the process runs."""
    import ctypes

    ctypes.PyDLL(None).usleep(int(seconds * 1e6))


def _controllers(sidecar) -> list[str]:
    reply = sidecar.hosts[0].connection.unary("ListSessions", pb.Empty(), 10)
    return [s.controller for s in reply.sessions]


def test_arrays_held_by_a_controller_whose_session_lapsed_never_change(make_cluster):
    sidecar = make_cluster(lease_seconds=2, heartbeat_seconds=0.5)
    argv = [sys.executable, program("lapse_holder"), sidecar.hosts[0].address, sidecar.token_file]
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "READY\n"  # type: ignore[union-attr]
        mine = f":{child.pid}"
        assert any(c.endswith(mine) for c in _controllers(sidecar))
        child.send_signal(signal.SIGSTOP)
        wait_for(lambda: not any(c.endswith(mine) for c in _controllers(sidecar)), "the session to lapse")
        child.send_signal(signal.SIGCONT)
        child.stdin.write("check\n")  # type: ignore[union-attr]
        child.stdin.flush()  # type: ignore[union-attr]
        assert child.stdout.readline() == "CHECK True True\n"  # type: ignore[union-attr]
    finally:
        child.send_signal(signal.SIGCONT)
        child.kill()
        child.wait()


def test_a_sidecar_that_did_not_run_for_longer_than_the_lease_keeps_its_sessions(make_cluster):
    c = make_cluster(processes=0, lease_seconds=1, heartbeat_seconds=0.25)
    host = c.hosts[0]
    counter = Counter.on(host)()  # type: ignore[attr-defined]
    assert counter.bump() == 1
    kept = filled.on(host)(1.0)
    hold_the_gil.on(host)(3.0)  # three leases without a keepalive read
    assert counter.bump() == 2  # a lapse would have ended the session and freed the object
    np.testing.assert_array_equal(filled.on(host)(2.0), 2.0)
    assert float(kept.min()) == float(kept.max()) == 1.0
