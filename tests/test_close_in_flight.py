"""A controller's `close()` ends its own calls in flight, in other threads, as a closed connection.

A thread may wait on a call (a sync call, a future with or without a limit, a stream's next
item) while another thread closes the cluster. The wait ends then, with a ColocarError saying
the connection was closed: never a hang, and never a HostLostError, which code that recovers
from a lost host would take a shutdown for. Over the local link and over gRPC alike.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
from helpers import wait_for
from interrupts_helpers import DEADLINE, wait_for_file

import colocar
from colocar.errors import ColocarError, HostLostError


@colocar.colocated
def items_until(path: str):
    """One item at once, the next once `path` exists (waiting for it: `path`.waiting)."""
    yield "first"
    open(path + ".waiting", "w").close()  # noqa: SIM115 - the marker the test waits for
    deadline = time.monotonic() + 600
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    yield "second"


def _bounded(host: Any, path: str) -> Any:
    future = wait_for_file.on(host).submit(path)
    return lambda: future.result(DEADLINE)


def _stream(host: Any, path: str) -> Any:
    items = items_until.on(host)(path)
    assert next(items) == "first"
    return lambda: next(items)


WAITS = {  # (what runs before the close, in the waiting thread) -> the wait that the close ends
    "sync": lambda host, path: lambda: wait_for_file.on(host)(path),
    "future": lambda host, path: wait_for_file.on(host).submit(path).result,
    "bounded future": _bounded,
    "stream": _stream,
}


@pytest.mark.timeout(2 * DEADLINE)
@pytest.mark.parametrize("shm", [True, False], ids=["link", "grpc"])
@pytest.mark.parametrize("kind", list(WAITS))
def test_closing_the_cluster_ends_a_wait_in_flight_as_closed_not_lost(make_cluster, tmp_path, kind, shm):
    c = make_cluster(hosts=1, processes=0, persist=True, shm=shm)  # the sidecar outlives the close
    host, stop = c.hosts[0], str(tmp_path / "stop")
    outcome: dict[str, Any] = {}
    started = threading.Event()

    def waiter() -> None:
        try:
            wait = WAITS[kind](host, stop)
            started.set()
            outcome["value"] = wait()
        except BaseException as e:  # noqa: BLE001 - what the close made of the wait
            outcome["error"] = e

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    assert started.wait(DEADLINE)
    if kind == "stream":
        wait_for(lambda: os.path.exists(stop + ".waiting") or "error" in outcome, "the stream to wait")
    else:
        wait_for(lambda: host.stats()["in_flight"] or "error" in outcome, "the call to run")
    c.close()
    thread.join(DEADLINE)
    open(stop, "w").close()  # noqa: SIM115 - lets the call on the sidecar end
    assert not thread.is_alive(), "the wait did not end when the cluster closed"
    error = outcome.get("error")
    assert isinstance(error, ColocarError) and not isinstance(error, HostLostError), outcome
    assert "closed" in str(error), error
    assert host.connection.session.lost is None
