"""What a controller holds does not change when its sidecar lapses its session and it comes
back (`sidecar/lapsed.py`).

A sidecar stopped past its lease (SIGSTOP, a frozen VM) lapses the session of a controller that
is alive, maps the arena and holds arrays over the session's blocks. It reconnects under the same
session id; the blocks must not have been reused meanwhile (they were: the held array changed).
Once the controller is gone, the blocks are freed.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
from helpers import wait_for

import colocar


@colocar.colocated
def filled(value):
    out = colocar.shm.empty((1 << 16,), np.float32)
    out[:] = value
    return out


def test_arrays_held_from_a_host_whose_session_lapsed_never_change(make_cluster):
    c = make_cluster(lease_seconds=2, heartbeat_seconds=0.5)
    host = c.hosts[0]
    held = filled.on(host)(1.0)
    process = c.processes[0]
    os.kill(process.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: host.connection.session.lost is not None, "the host to be marked lost")
        time.sleep(3)  # past the sidecar's 2 s lease
    finally:
        os.kill(process.pid, signal.SIGCONT)
    wait_for(lambda: host.connection.session.lost is None, "the controller to reconnect", timeout=60)
    for _ in range(3):
        np.testing.assert_array_equal(filled.on(host)(2.0), 2.0)
    assert float(held.min()) == float(held.max()) == 1.0, (held.min(), held.max())
