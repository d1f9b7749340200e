"""A lost host fails what waits on it as soon as it is lost, whatever waits: a multi-host array
call (its other hosts are told to drop their part), or a thread that has no local-link socket yet.

Every test here breaks sidecars, so each starts its own small cluster (`make_cluster`).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from typing import Any

import jax
import numpy as np
import psutil
import pytest
from failures_helpers import DEADLINE, echo, in_thread
from helpers import sigstop, wait_for
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import colocar


@colocar.colocated(processes=True)
def mark_and_wait_in_worker(x, marks, stop, limit=120.0):
    """Writes its worker's pid to a file of its own in `marks`, then waits (at most `limit` s)
    until `stop` exists: one host's part of an array call that outlives the other host."""
    import time

    with open(os.path.join(marks, f"{os.getpid()}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(marks, f"{os.getpid()}.tmp"), os.path.join(marks, str(os.getpid())))
    deadline = time.monotonic() + limit
    while not os.path.exists(stop) and time.monotonic() < deadline:
        time.sleep(0.02)
    return x + 1


@colocar.colocated(processes=True)
def plus_one(x):
    return x + 1


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _used(host: Any) -> int:
    return host.stats()["pools"]["default"]["used"]


# --- 3. a host killed during a multi-host array call --------------------------------------------
@pytest.mark.parametrize(
    ("sig", "shm"),
    [(signal.SIGKILL, True), (signal.SIGSTOP, True), (signal.SIGKILL, False)],
    ids=["killed", "stopped", "killed-grpc"],
)
def test_a_host_lost_mid_array_call_fails_it_at_once_and_cancels_the_others(sig, shm, make_cluster, tmp_path):
    c = make_cluster(hosts=2, processes=1, shm=shm)
    survivor, victim = c.hosts
    mesh = c.mesh(("data",))
    x = jax.device_put(np.arange(64, dtype=np.float32), NamedSharding(mesh, P("data")))
    np.testing.assert_array_equal(np.asarray(plus_one(x)), np.arange(64) + 1)  # workers are up
    baseline = _used(survivor)
    marks, stop = tmp_path / "marks", str(tmp_path / "stop")
    marks.mkdir()
    future = mark_and_wait_in_worker.submit(x, str(marks), stop)
    wait_for(lambda: len(os.listdir(marks)) == 2, "both hosts' parts to start")
    children = {p.pid for p in psutil.Process(c.processes[0].pid).children(recursive=True)}
    survivor_worker = {int(name) for name in os.listdir(marks)} & children
    assert len(survivor_worker) == 1
    try:
        os.kill(c.processes[1].pid, sig)
        _, error = in_thread(future.result, timeout=DEADLINE)  # was: once the survivor ended
        assert isinstance(error, colocar.HostLostError), repr(error)
        assert victim.name in str(error) and survivor.name in str(error), str(error)
        # The survivor's part was cancelled: its worker is stopped, its blocks are back, and the
        # next call runs at once and gets its own result.
        wait_for(lambda: all(_gone(pid) for pid in survivor_worker), "the survivor's worker to stop")
        np.testing.assert_array_equal(plus_one.on(survivor)(np.arange(8)), np.arange(8) + 1)
        wait_for(lambda: _used(survivor) == baseline, "the survivor's arena use to return to its baseline")
        wait_for(lambda: survivor.stats()["abandoned_calls"] == 0, "no abandoned call on the survivor")
    finally:
        open(stop, "w").close()
        if sig == signal.SIGSTOP:
            os.kill(c.processes[1].pid, signal.SIGCONT)
            c.processes[1].kill()


# --- 4. a stopped sidecar, seen from a new thread and from a new local-link socket ---------------
def test_a_stopped_sidecar_is_a_lost_host_from_a_new_thread_too(make_cluster):
    c = make_cluster()
    host = c.hosts[0]
    assert host.connection.transport.link is not None  # calls go over the local link
    assert echo.on(host)(1) == ((1,), {})  # the link has one idle socket now
    process = c.processes[0]
    errors: dict[str, BaseException | None] = {}
    new_thread = threading.Thread(target=lambda: errors.update(new=in_thread(lambda: echo.on(host)(2))[1]))
    try:
        sigstop(process.pid)
        new_thread.start()  # of this call and the next, one takes the idle socket (never
        future = echo.on(host).submit(6)  # answered), the other opens one (never greeted)
        try:
            echo.on(host)(3)  # queued behind the future on this thread's lane
        except BaseException as e:  # noqa: BLE001 - checked below
            errors["old"] = e
        new_thread.join(DEADLINE)
        assert not new_thread.is_alive()
        errors["pool"] = future.exception(timeout=DEADLINE)
    finally:
        os.kill(process.pid, signal.SIGCONT)
        process.kill()
    for which in ("new", "old", "pool"):  # was: CallTimeoutError after 10 s from the new thread
        assert isinstance(errors[which], colocar.HostLostError), f"{which} thread: {errors[which]!r}"
        assert host.name in str(errors[which])


def test_a_full_link_backlog_is_waited_out_not_taken_for_a_lost_host(make_cluster):
    # A long heartbeat: the sidecar is stopped for far less than the keepalive's three periods.
    # A lease longer than it: one of 2 s lapsed between keepalives on a slow machine, and a call
    # that came then failed ("the sidecar lost this session").
    c = make_cluster(heartbeat_seconds=3.0, lease_seconds=10)
    host = c.hosts[0]
    link = host.connection.transport.link
    assert link is not None
    process = c.processes[0]
    fillers: list[socket.socket] = []
    box: dict[str, Any] = {}
    caller = threading.Thread(target=lambda: box.update(result=in_thread(lambda: echo.on(host)(4))))
    try:
        sigstop(process.pid)  # it accepts nothing: its listener's backlog fills
        while True:
            filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            filler.setblocking(False)
            try:
                filler.connect(link.path)
            except BlockingIOError:
                filler.close()
                break
            fillers.append(filler)
        caller.start()  # a new thread: its first call must connect, and finds the backlog full
        caller.join(0.3)
    finally:
        os.kill(process.pid, signal.SIGCONT)
        for filler in fillers:
            filler.close()
    caller.join(DEADLINE)
    assert not caller.is_alive()
    assert box["result"] == (((4,), {}), None)  # was: HostLostError ("local link broke") at once
    assert host.connection.session.lost is None
    assert echo.on(host)(5) == ((5,), {})
