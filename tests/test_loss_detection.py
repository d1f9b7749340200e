"""A local sidecar that dies is marked lost at once, not at the next heartbeat.

The heartbeat here is 30 s, so only the exit watch (a pidfd per sidecar) can mark the host lost
within the deadlines below. A restarted sidecar gets a watch of its own; the old process never
marks the new session; closing the cluster ends the watch's thread.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from colocar.elastic import faults

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs Linux pidfds")


def _lost_within(host, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while host.connection.session.lost is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _watch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "colocar-exit-watch"]


def _log_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("colocar-logs-")}


def test_a_killed_sidecar_is_lost_before_any_heartbeat(make_cluster):
    before, logs_before = len(_watch_threads()), _log_threads()
    c = make_cluster(hosts=2, processes=0, heartbeat_seconds=30, lease_seconds=120)
    assert len(_watch_threads()) == before + 1
    faults.inject(c, faults.kill(1))
    assert _lost_within(c.hosts[1], 10), "lost only at a heartbeat (30 s), not when it died"
    assert "exited with code -9" in str(c.hosts[1].connection.session.lost)
    assert c.hosts[0].connection.session.lost is None
    c.processes[1].wait(timeout=30)
    c.restart_host(1, address="127.0.0.1:0")  # the new session is watched, and only by the new process
    assert c.hosts[1].connection.session.lost is None
    faults.inject(c, faults.kill(1))
    assert _lost_within(c.hosts[1], 10)
    c.close()
    assert len(_watch_threads()) == before
    # the lost host's log forwarder, pausing a heartbeat (30 s) between retries, ended with close()
    assert _log_threads() <= logs_before
