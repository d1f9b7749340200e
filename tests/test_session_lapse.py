"""What a controller holds must not change when its sidecar lapses its session and it comes
back: a known gap, kept here until it is fixed (see the issue notes of 2026-12-01).

The sidecar frees a lapsed session's blocks; a controller on the same host that still holds
arrays aliasing them (it maps the arena) then reconnects under the same session id, and its next
results reuse those blocks: the held array changes. A sidecar stopped past its lease (SIGSTOP,
a frozen VM) is enough.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from helpers import wait_for

import colocar


@colocar.colocated
def filled(value):
    out = colocar.shm.empty((1 << 16,), np.float32)
    out[:] = value
    return out


@pytest.mark.xfail(strict=True, reason="a lapsed session's blocks are freed while its controller maps them")
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
