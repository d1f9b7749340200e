"""Lost processes never hang the caller nor leak: killed or stopped sidecars, killed
controllers and their leases, graceful shutdown, and seeded kills during a stream of calls.

Every test here breaks sidecars, so each starts its own small clusters (`make_cluster`).
"""

from __future__ import annotations

import gc
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import psutil
import pytest
from failures_helpers import (
    DEADLINE,
    Counter,
    Holder,
    MiB,
    arena_files,
    arena_sum,
    echo,
    in_thread,
    mark_and_sleep,
    usage,
)
from helpers import program, sidecar_pid, wait_for, worker_pid

import colocar
from colocar.controller_bridge.cluster import Host
from colocar.controller_bridge.connection import HostConnection


# --- 4./5. a sidecar killed or stopped mid-call -------------------------------------------------
def _lost_mid_call(c: Any, tmp_path: Any, sig: int) -> None:
    host = c.hosts[0]
    process = c.processes[0]
    assert worker_pid.on(host)() != process.pid  # a worker process exists too
    workers = psutil.Process(process.pid).children(recursive=True)
    assert workers
    future = mark_and_sleep.on(host).submit(str(tmp_path / "a"), 60)
    box: dict[str, Any] = {}

    def sync_call() -> None:
        try:
            box["value"] = mark_and_sleep.on(host)(str(tmp_path / "b"), 60)
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    thread = threading.Thread(target=sync_call, daemon=True)
    thread.start()
    wait_for(lambda: (tmp_path / "a").exists() and (tmp_path / "b").exists(), "both calls to start")

    os.kill(process.pid, sig)
    error = future.exception(timeout=DEADLINE)
    assert isinstance(error, colocar.HostLostError), repr(error)
    assert host.name in str(error)
    thread.join(DEADLINE)
    assert not thread.is_alive(), "the synchronous call hangs"
    assert isinstance(box.get("error"), colocar.HostLostError), box

    # new calls fail at once, never hang
    for call in (lambda: sidecar_pid.on(host)(), lambda: Counter.on(host)(), lambda: host.stats()):
        _, error = in_thread(call, timeout=10)
        assert isinstance(error, colocar.HostLostError), repr(error)
    if sig == signal.SIGKILL:
        # the sidecar's worker processes do not outlive it
        wait_for(
            lambda: not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers),
            "the worker processes of the killed sidecar to exit",
        )


def test_sigkill_mid_call_raises_host_lost(make_cluster, tmp_path, shm_dir):
    c = make_cluster()
    arena = os.path.basename(c.hosts[0].connection.session.info.arena_path)
    assert arena in arena_files(shm_dir)
    _lost_mid_call(c, tmp_path, signal.SIGKILL)
    # a killed sidecar (an OOM kill) cannot clean up: its controller, which saw it die, does
    wait_for(lambda: arena not in arena_files(shm_dir), "the controller to remove the killed sidecar's arena")
    c.close()
    assert arena not in arena_files(shm_dir)


@colocar.colocated(processes=True)
def spin_in_a_worker(started):
    open(started, "w").close()
    while True:  # busy in user code: it never reads a stop message
        pass


def test_an_oom_killed_sidecar_leaves_no_process_and_no_file(make_cluster, tmp_path, shm_dir):
    """SIGKILL, as the OOM killer sends it: the sidecar cannot stop its workers nor remove its
    arena; its workers (a call busy in user code, a pipeline's) end with it, and its controller
    removes the arena at once."""
    c = make_cluster(processes=1)
    host, process = c.hosts[0], c.processes[0]
    arena = os.path.basename(host.connection.session.info.arena_path)
    it = colocar.loaders.load({"source": {"kind": "range", "n": 1 << 16}, "global_batch_size": 8}, c)
    next(it)
    spinning = spin_in_a_worker.on(host).submit(str(tmp_path / "spinning"))
    wait_for((tmp_path / "spinning").exists, "the worker to spin")
    descendants = psutil.Process(process.pid).children(recursive=True)
    assert len(descendants) >= 3  # the forkserver, a call worker, a pipeline worker
    process.kill()
    wait_for(
        lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in descendants),
        "every process of the killed sidecar to end",
    )
    wait_for(lambda: arena not in arena_files(shm_dir), "its controller to remove its arena")
    assert isinstance(spinning.exception(timeout=DEADLINE), colocar.HostLostError)
    it.close()


def test_sigstop_mid_call_raises_host_lost(make_cluster, tmp_path, shm_dir):
    c = make_cluster()
    arena = os.path.basename(c.hosts[0].connection.session.info.arena_path)
    try:
        _lost_mid_call(c, tmp_path, signal.SIGSTOP)
    finally:
        os.kill(c.processes[0].pid, signal.SIGCONT)
        c.processes[0].kill()
    c.close()
    assert arena not in arena_files(shm_dir)


def test_killed_controller_frees_its_objects_after_the_lease(make_cluster, tmp_path):
    c = make_cluster(persist=False, lease_seconds=2)
    host = c.hosts[0]
    base_objects, base_sessions, base_used = usage(host)
    ready = tmp_path / "ready"
    log = open(tmp_path / "controller.log", "wb")
    controller = subprocess.Popen(
        [sys.executable, program("failures_controller"), host.address, c.token_file, str(ready)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"},
    )
    try:
        wait_for(
            lambda: ready.exists() or controller.poll() is not None, "the controller subprocess", timeout=120
        )
        assert controller.poll() is None, (tmp_path / "controller.log").read_text()
        objects, sessions, used = usage(host)
        assert objects == base_objects + 4 and sessions == base_sessions + 1
        assert used >= base_used + 2 * MiB
    finally:
        controller.kill()
        controller.wait(DEADLINE)
        log.close()
    wait_for(lambda: usage(host) == (base_objects, base_sessions, base_used), "the lease to free everything")


def test_close_frees_objects_now(make_cluster):
    c = make_cluster(lease_seconds=120)  # far longer than the wait below: only Disconnect can free
    host = c.hosts[0]
    base = usage(host)
    with open(c.token_file) as f:
        token = f.read().strip()

    # a bare HostConnection
    conn = HostConnection(host.address, "extra", token, lease_seconds=120, heartbeat_seconds=0.5)
    try:
        extra = Host(0, conn, [])
        holders = [Holder.on(extra)(MiB), Holder.on(extra)(64)]
        staged = conn.blocks.empty([((MiB,), np.uint8)])
        objects, sessions, used = usage(host)
        assert (objects, sessions) == (base[0] + 2, base[1] + 1) and used >= base[2] + 2 * MiB
    finally:
        conn.close()
    # the objects go at once; the staged array this process still holds keeps its block ...
    held = (base[0], base[1], base[2] + MiB)
    wait_for(lambda: usage(host) == held, "Disconnect to free the objects", timeout=10)
    del holders, staged
    gc.collect()
    # ... until it is gone (then the mapping it kept alive is too)
    wait_for(lambda: usage(host) == base, "the staged array's block to go with it", timeout=10)

    # a whole cluster from connect()
    other = colocar.connect([host.address], token=token, devices=[[]], lease_seconds=120)
    try:
        holder = Holder.on(other.hosts[0])(MiB)
        assert usage(host)[:2] == (base[0] + 1, base[1] + 1)
    finally:
        other.close()
    wait_for(lambda: usage(host) == base, "cluster.close() to free the objects", timeout=10)
    del holder


# --- 10. graceful shutdown ----------------------------------------------------------------------
def test_sigterm_drains_in_flight_calls(make_cluster, tmp_path, shm_dir):
    c = make_cluster()
    host, process = c.hosts[0], c.processes[0]
    arena = os.path.basename(host.connection.session.info.arena_path)
    future = mark_and_sleep.on(host).submit(str(tmp_path / "started"), 2)
    wait_for((tmp_path / "started").exists, "the call to start")
    process.send_signal(signal.SIGTERM)
    assert future.result(DEADLINE) == 2
    assert process.wait(DEADLINE) == 0
    assert arena not in arena_files(shm_dir)


# --- 11. seeded kills during a stream of calls --------------------------------------------------
Outcome = tuple[int, str, str, BaseException | None]


def _one_call(
    r: random.Random, kind: str, i: int, hosts: list[Any], counters: list[Any], payload: Any
) -> None:
    """Makes one call of `kind` on host i (on both hosts for "both"); raises what it raised."""
    if kind == "sync":
        assert sidecar_pid.on(hosts[i])() > 0
    elif kind == "submit":
        futures = [echo.on(hosts[i]).submit(k) for k in range(r.randint(1, 4))]
        assert [f.result(DEADLINE)[0] for f in futures] == [(k,) for k in range(len(futures))]
    elif kind == "both":
        assert len(sidecar_pid.on(hosts)()) == 2
    elif kind == "array":
        assert arena_sum.on(hosts[i])(payload) == int(payload.sum())
    elif kind == "method":
        assert counters[i].bump() > 0
    elif kind == "worker":
        assert worker_pid.on(hosts[i])() > 0
    else:
        assert mark_and_sleep.on(hosts[i])(os.devnull, r.uniform(0, 0.05)) >= 0


def _assert_only_the_victim_failed(seed: int, victim: int, outcomes: list[Outcome]) -> None:
    """Every failed call was on the killed host and raised HostLostError; some did fail."""
    for i, kind, status, error in outcomes:
        if status == "ok":
            continue
        assert i == victim, f"seed {seed}: {kind} on the surviving host failed: {error!r}"
        assert isinstance(error, colocar.HostLostError), f"seed {seed}: {kind} raised {error!r}"
    assert any(i == victim and status == "error" for i, _, status, _ in outcomes), f"seed {seed}"


def _kill_during_stream(seed: int, make_cluster: Callable[..., Any]) -> None:
    rng = random.Random(seed)
    c = make_cluster(hosts=2, processes=1)
    victim = rng.randrange(2)
    hosts = c.hosts
    counters = [Counter.on(h)() for h in hosts]
    payload = np.arange(64 * 1024, dtype=np.float32)
    kinds = ["sync", "submit", "both", "array", "method", "worker", "sleep"]
    outcomes: list[Outcome] = []
    outcomes_lock = threading.Lock()
    stop = threading.Event()

    def stream(thread_seed: int) -> None:
        r = random.Random(thread_seed)
        while not stop.is_set():
            i = r.randrange(2)
            kind = r.choice(kinds)
            if kind == "both":
                i = victim
            error: BaseException | None = None
            try:
                _one_call(r, kind, i, hosts, counters, payload)
            except BaseException as e:  # noqa: BLE001 - judged below
                error = e
            with outcomes_lock:
                outcomes.append((i, kind, "error" if error else "ok", error))

    threads = [threading.Thread(target=stream, args=(seed * 100 + t,), daemon=True) for t in range(3)]
    for t in threads:
        t.start()
    time.sleep(rng.uniform(0.0, 0.8))  # when to kill: chosen by the seed, not asserted
    with outcomes_lock:
        before = len(outcomes)
    os.kill(c.processes[victim].pid, signal.SIGKILL)
    # keep calling for a while after the kill, then stop
    wait_for(
        lambda: len(outcomes) >= before + 30 or not any(t.is_alive() for t in threads), "calls after kill"
    )
    stop.set()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), f"seed {seed}: a call hangs after the kill"
    _assert_only_the_victim_failed(seed, victim, outcomes)
    survivor = hosts[1 - victim]
    assert sidecar_pid.on(survivor)() == c.processes[1 - victim].pid
    counters.clear()
    gc.collect()


@pytest.mark.parametrize("seed", [0, 1])
def test_kill_during_stream(seed, make_cluster):
    _kill_during_stream(seed, make_cluster)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2, 22))
def test_kill_during_stream_many_seeds(seed, make_cluster):
    _kill_during_stream(seed, make_cluster)
