"""A result that finishes after its session closed holds no arena block.

Closing a session frees every block it leases. A call still running in a sidecar thread, or a
stream's generator still producing, used to encode its result under the closed session's id
afterwards: blocks nobody would ever free. The allocator now refuses a closed session's id.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest
from helpers import wait_for

import colocar

ROWS = 64 * 1024  # a result of 256 KiB: it takes an arena block


def _wait_for(path: str) -> None:
    deadline = time.monotonic() + 120
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)


@colocar.colocated
def late_result(go: str, finished: str) -> np.ndarray:
    _wait_for(go)
    open(finished, "w").close()  # noqa: SIM115 - the marker the test waits for
    return np.ones(ROWS, np.float32)


@colocar.colocated
def late_items(go: str, finished: str):
    yield 1
    try:
        _wait_for(go)
        yield np.ones(ROWS, np.float32)  # produced after the session closed
    finally:
        open(finished, "w").close()  # noqa: SIM115 - the stream closed its generator


def _used(c: Any) -> int:
    return c.hosts[0].stats()["pools"]["default"]["used"]


@pytest.mark.parametrize("kind", ["call", "stream"])
def test_a_result_finishing_after_its_session_closed_holds_no_block(kind, make_cluster, tmp_path):
    c = make_cluster(hosts=1, persist=True)
    go, finished = str(tmp_path / "go"), str(tmp_path / "finished")
    if kind == "call":
        late_result.on(c.hosts[0]).submit(go, finished)
    else:
        items = late_items.on(c.hosts[0])(go, finished)
        assert next(items) == 1
    with open(c.token_file) as f:
        observer = colocar.connect([c.hosts[0].address], token=f.read().strip(), shm=False)
    try:
        c.close()  # the sidecar keeps running (persist=True); the call or stream goes on
        open(go, "w").close()  # noqa: SIM115
        wait_for(lambda: os.path.exists(finished), "the late result to be made")
        wait_for(lambda: observer.hosts[0].stats()["in_flight"] == 0, "the late call to end")
        wait_for(lambda: _used(observer) == 0, "the arena to be empty")
    finally:
        observer.close()
