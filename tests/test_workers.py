"""`@colocated(processes=True)`: functions run in the sidecar's worker processes.

Workers are real processes (forkserver children of the sidecar) that map the arena
themselves: inputs arrive as arena views and array results are written into arena blocks.
These tests use a private one-host cluster (module scope), so that killing a worker and
counting arena bytes does not disturb the shared fixtures.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
from typing import Any

import numpy as np
import psutil
import pytest
from helpers import recorded_stdout, sidecar_pid, wait_for, worker_pid

import colocar
from colocar.shm import block_of

MiB = 1 << 20
DEADLINE = 30.0


def used(host: Any) -> dict[str, int]:
    return {name: pool["used"] for name, pool in host.stats()["pools"].items()}


@pytest.fixture(scope="module")
def wcluster():
    with colocar.local_cluster(
        hosts=1,
        arena_size=32 * MiB,
        pools={"ckpt": 4 * MiB},
        processes=2,
        lease_seconds=5,
        heartbeat_seconds=0.5,
    ) as c:
        yield c


@pytest.fixture
def host(wcluster):
    """The worker cluster's host; after each test, its arena use returns to where it was."""
    h = wcluster.hosts[0]
    before = used(h)
    yield h
    gc.collect()
    wait_for(lambda: used(h) == before, f"arena use to return to {before} (now {used(h)})")


# --- shipped code -------------------------------------------------------------------------------
class WorkerError(Exception):
    pass


@colocar.colocated(processes=True)
def sum_of_squares(n):
    return sum(i * i for i in range(n)), os.getpid()


@colocar.colocated(processes=True)
def worker_raises(n):
    raise WorkerError(f"worker failure {n}")


@colocar.colocated(processes=True)
def worker_returns_lock():
    return threading.Lock()


@colocar.colocated(processes=True)
def fill(n, value, pool="default"):
    out = colocar.shm.empty((n,), np.float32, pool=pool)
    out[:] = value
    return out, colocar.shm.in_sidecar(), os.getpid()


@colocar.colocated(processes=True)
def plain_numpy(n):
    return np.full(n, 2.5, np.float32)  # not in the arena: the worker copies it into a block


@colocar.colocated(processes=True)
def inspect_input(x):
    return block_of(x) is not None, float(x.sum()), os.getpid()


@colocar.colocated(processes=True)
def spin_until(started, stop, limit=60.0):
    """Pure-Python spinning (holds its process's GIL) until `stop` exists."""
    with open(started, "w"):
        pass
    spins = 0
    deadline = time.monotonic() + limit
    while not os.path.exists(stop) and time.monotonic() < deadline:
        for _ in range(10_000):
            spins += 1
    return os.path.exists(stop), spins, os.getpid()


@colocar.colocated(processes=True)
def die(pid_file, hold_bytes):
    held = colocar.shm.empty((hold_bytes,), np.uint8)  # a block the dead worker never returns
    held[:] = 1
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGKILL)


@colocar.colocated(processes=True)
def sleep_marked(pid_file, seconds):
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(seconds)
    return seconds


@colocar.colocated(processes=True)
def talk(tag):
    print(f"hello from worker {tag}")
    print(f"on stderr {tag}", file=sys.stderr)
    print(f"unterminated {tag}", end="")
    return os.getpid()


# --- 1. round trips -----------------------------------------------------------------------------
def test_worker_is_another_process(wcluster, host):
    sidecar = sidecar_pid.on(host)()
    assert sidecar == wcluster.processes[0].pid
    total, pid = sum_of_squares.on(host)(20_000)
    assert total == sum(i * i for i in range(20_000))
    assert pid not in (sidecar, os.getpid())
    assert pid in {p.pid for p in psutil.Process(sidecar).children(recursive=True)}
    assert host.stats()["worker_processes"] >= 1

    k = 7
    add_k = colocar.colocated(lambda x: (x + k, os.getpid()), processes=True)
    value, lambda_pid = add_k.on(host)(1)
    assert value == 8 and lambda_pid != sidecar

    def make_scaler(factor):
        def scale(values):
            return [factor * v for v in values], os.getpid() != sidecar

        return scale

    assert colocar.colocated(make_scaler(3), processes=True).on(host)([1, 2]) == ([3, 6], True)
    futures = [sum_of_squares.on(host).submit(n) for n in range(1, 6)]
    assert [f.result(DEADLINE)[0] for f in futures] == [sum(i * i for i in range(n)) for n in range(1, 6)]


def test_worker_errors_come_back(host):
    with pytest.raises(WorkerError, match="worker failure 4") as info:
        worker_raises.on(host)(4)
    assert info.value.colocar_host == host.name and "worker_raises" in str(info.value.__cause__)
    with pytest.raises(colocar.SerializationError, match=r"result of .*worker_returns_lock"):
        worker_returns_lock.on(host)()
    assert worker_pid.on(host)() != sidecar_pid.on(host)()


# --- 2. arrays through the arena ----------------------------------------------------------------
def test_worker_results_and_inputs_are_arena_views(host):
    out, in_sidecar, pid = fill.on(host)(256 * 1024, 3.0)
    assert in_sidecar and pid != sidecar_pid.on(host)()
    assert block_of(out) is not None and block_of(out)[0] is host.connection.blocks.arena
    assert out.shape == (256 * 1024,) and float(out[0]) == float(out[-1]) == 3.0
    assert used(host)["default"] >= out.nbytes

    copied = plain_numpy.on(host)(100_000)
    assert block_of(copied)[0] is host.connection.blocks.arena and float(copied.sum()) == 2.5 * 100_000

    x = np.ones(64 * 1024, np.float32)
    in_arena, total, _ = inspect_input.on(host)(x)
    assert in_arena and total == x.size
    in_arena, total, _ = inspect_input.on(host)(out)  # an arena result goes back without a copy
    assert in_arena and total == 3.0 * out.size


def test_worker_allocates_in_the_named_pool(host):
    before = used(host)
    out, _, _ = fill.on(host)(MiB // 4, 1.0, pool="ckpt")  # 1 MiB of float32
    now = used(host)
    assert now["ckpt"] >= before["ckpt"] + MiB and now["default"] == before["default"]
    assert float(out.sum()) == MiB // 4
    with pytest.raises(KeyError, match="nope"):
        fill.on(host)(16, 1.0, pool="nope")


# --- 3. workers do not hold the sidecar's GIL ---------------------------------------------------
def test_thread_calls_proceed_while_a_worker_spins(host, tmp_path):
    started, stop = tmp_path / "started", tmp_path / "stop"
    try:
        spinning = spin_until.on(host).submit(str(started), str(stop))
        wait_for(started.exists, "the worker to start spinning")
        sidecar: list[int] = []

        def thread_calls() -> None:  # another controller thread: its own call lane
            sidecar.extend(sidecar_pid.on(host)() for _ in range(20))

        caller = threading.Thread(target=thread_calls, daemon=True)
        caller.start()
        caller.join(DEADLINE)
        assert not caller.is_alive() and len(sidecar) == 20
        assert not spinning.done(), "the worker returned before the thread-mode calls completed"
    finally:
        stop.touch()
    stopped, spins, pid = spinning.result(DEADLINE)
    assert stopped and spins > 0
    assert set(sidecar) == {sidecar_pid.on(host)()} and pid not in sidecar


# --- 4. a worker killed mid-call ----------------------------------------------------------------
def test_worker_killed_mid_call(host, tmp_path):
    pid_file = tmp_path / "pid"
    with pytest.raises(Exception, match=r"worker process .*died") as info:
        die.on(host)(str(pid_file), MiB)
    dead = int(pid_file.read_text())
    assert str(dead) in str(info.value) and info.value.colocar_host == host.name
    assert not psutil.pid_exists(dead) or psutil.Process(dead).status() == psutil.STATUS_ZOMBIE
    fresh = [worker_pid.on(host)() for _ in range(4)]
    assert dead not in fresh

    # killed from outside while it sleeps
    future = sleep_marked.on(host).submit(str(pid_file.with_suffix(".2")), 60)
    victim = int(
        wait_for(
            lambda: pid_file.with_suffix(".2").exists() and pid_file.with_suffix(".2").read_text(),
            "the worker to start",
        )
    )
    os.kill(victim, signal.SIGKILL)
    error = future.exception(DEADLINE)
    assert error is not None and "died" in str(error) and str(victim) in str(error)
    assert sleep_marked.on(host)(str(pid_file.with_suffix(".3")), 0) == 0
    assert victim not in {worker_pid.on(host)() for _ in range(4)}


# --- 5. logs ------------------------------------------------------------------------------------
def test_worker_output_reaches_the_controller(host):
    tag = f"tag-{os.getpid()}-{time.monotonic_ns()}"

    def arrived() -> bool:
        seen = stdout.getvalue()
        return all(
            f"[{host.name}] {line} {tag}" in seen
            for line in ("hello from worker", "on stderr", "unterminated")
        )

    with recorded_stdout() as stdout:
        assert talk.on(host)(tag) != sidecar_pid.on(host)()
        wait_for(arrived, "the worker's lines on the controller's stdout")


# --- 6. no blocks leak --------------------------------------------------------------------------
def test_results_hold_blocks_until_dropped(host):
    before = used(host)
    results = [fill.on(host)(128 * 1024, float(i)) for i in range(6)]
    x = np.ones(128 * 1024, np.float32)
    echoed = [inspect_input.on(host)(x) for _ in range(3)]
    assert used(host)["default"] >= before["default"] + 6 * 512 * 1024
    assert [float(r[0][0]) for r in results] == [float(i) for i in range(6)]
    del results, echoed
    gc.collect()
    wait_for(lambda: used(host) == before, "the blocks of dropped results to be freed")
