"""Failures reach the caller as errors, never hangs or leaks: remote exceptions, bad values,
missing modules, killed or stopped sidecars, killed controllers, leases, full pools,
timeouts, cancellation, graceful shutdown and seeded kills during a stream of calls.

Tests that break sidecars start their own small clusters (`make_cluster`); the shared
`cluster` fixture is only used for calls that leave it as it was.
"""

from __future__ import annotations

import gc
import importlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import CancelledError
from typing import Any

import numpy as np
import psutil
import pytest
from helpers import sidecar_pid, wait_for, worker_pid

import colocar
from colocar.controller_bridge.cluster import Host
from colocar.controller_bridge.connection import HostConnection
from colocar.shm import ArenaFullError

MiB = 1 << 20
DEADLINE = 30.0  # seconds any expected event may take before the test fails


# --- helpers ------------------------------------------------------------------------------------


def in_thread(fn: Callable[[], Any], timeout: float = DEADLINE) -> tuple[Any, BaseException | None]:
    """Runs fn in a thread; (value, exception); fails if it has not finished within `timeout`."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"call did not return within {timeout} s"
    return box.get("value"), box.get("error")


def usage(host: Host) -> tuple[int, int, int]:
    """(objects, sessions, bytes used in the default pool) on the host."""
    s = host.stats()
    return s["objects"], s["sessions"], s["pools"]["default"]["used"]


def arena_files(shm_dir: str) -> list[str]:
    return os.listdir(shm_dir) if os.path.isdir(shm_dir) else []


# --- shipped code used by the tests (the sidecars import this module) --------------------------
class CustomError(Exception):
    """A user exception class that the controller can rebuild."""

    def __init__(self, message: str, code: int = 0):
        super().__init__(message, code)
        self.code = code


class UnrebuildableError(Exception):
    """Pickles, but cannot be unpickled (its __init__ needs two arguments, args holds one)."""

    def __init__(self, left: str, right: str):
        super().__init__(f"{left} and {right}")


@colocar.colocated
def raise_value_error(n):
    raise ValueError(f"bad value {n}")  # the remote traceback shows this line


@colocar.colocated
def raise_custom(n):
    raise CustomError(f"custom failure {n}", code=n)


@colocar.colocated
def raise_unrebuildable():
    raise UnrebuildableError("left", "right")


@colocar.colocated
def raise_with_lock():
    e = RuntimeError("holds a lock")
    e.lock = threading.Lock()
    raise e


@colocar.colocated
def echo(*args, **kwargs):
    return args, kwargs


@colocar.colocated
def make_lock():
    return threading.Lock()


@colocar.colocated
def mark_and_sleep(path, seconds):
    """Signals that it started (creates `path`), then sleeps."""
    with open(path, "w"):
        pass
    time.sleep(seconds)
    return seconds


@colocar.colocated
def mark_and_wait(started, stop, limit=60.0):
    """Signals that it started, then waits until `stop` exists (at most `limit` s)."""
    with open(started, "w"):
        pass
    deadline = time.monotonic() + limit
    while not os.path.exists(stop) and time.monotonic() < deadline:
        time.sleep(0.02)
    return os.path.exists(stop)


@colocar.colocated(timeout=1)
def wait_with_timeout(started, stop):
    with open(started, "w"):
        pass
    deadline = time.monotonic() + 10
    while not os.path.exists(stop) and time.monotonic() < deadline:
        time.sleep(0.02)
    return "finished"


@colocar.colocated_class
class Holder:
    """A remote object that holds arena memory."""

    def __init__(self, nbytes, pool="default"):
        self.arrays = []
        self.grab(nbytes, pool)

    def grab(self, nbytes, pool="default"):
        array = colocar.shm.empty((nbytes,), np.uint8, pool=pool)
        array[:] = len(self.arrays) + 1
        self.arrays.append(array)
        return len(self.arrays)

    def check(self):
        return all(bool((a == i + 1).all()) for i, a in enumerate(self.arrays))

    def drop(self):
        self.arrays.clear()


@colocar.colocated_class
class Counter:
    def __init__(self):
        self.n = 0

    def bump(self):
        self.n += 1
        return self.n

    def value(self):
        return self.n


@colocar.colocated
def arena_sum(x):
    return int(x.sum())


@colocar.colocated
def make_array(n, value, pool="default"):
    out = colocar.shm.empty((n,), np.uint8, pool=pool)
    out[:] = value
    return out


# --- 1. remote exceptions -----------------------------------------------------------------------
def test_exception_keeps_its_type_traceback_and_host(cluster):
    host = cluster.hosts[1]
    with pytest.raises(ValueError, match="bad value 7") as info:
        raise_value_error.on(host)(7)
    e = info.value
    assert type(e) is ValueError
    assert e.colocar_host == host.name
    assert any(host.name in note for note in e.__notes__)
    remote = str(e.__cause__)
    assert "in raise_value_error" in remote and "ValueError: bad value 7" in remote
    assert host.name in remote

    future = raise_custom.on(host).submit(3)
    e = future.exception(timeout=DEADLINE)
    assert type(e) is CustomError and e.code == 3 and "custom failure 3" in str(e)
    assert e.colocar_host == host.name and "raise_custom" in str(e.__cause__)


@pytest.mark.parametrize("fn", [raise_unrebuildable, raise_with_lock], ids=["unpickle-fails", "pickle-fails"])
def test_exception_that_cannot_come_back_is_remote_error(cluster, fn):
    host = cluster.hosts[0]
    with pytest.raises(colocar.RemoteError) as info:
        fn.on(host)()
    e = info.value
    expected = "UnrebuildableError" if fn is raise_unrebuildable else "RuntimeError"
    assert e.type_name.endswith(expected)
    assert e.remote_message == ("left and right" if fn is raise_unrebuildable else "holds a lock")
    assert fn.__name__ in e.remote_traceback and expected in e.remote_traceback
    assert e.host == host.name and host.name in str(e)
    assert e.colocar_host == host.name


# --- 2. values that cannot be pickled -----------------------------------------------------------
def test_unpicklable_arguments_and_results(cluster):
    host = cluster.hosts[0]
    with pytest.raises(colocar.SerializationError, match=r"argument 1 \(<unlocked _thread.lock"):
        echo.on(host)(1, threading.Lock())
    with pytest.raises(colocar.SerializationError, match="keyword argument 'guard'"):
        echo.on(host).submit(1, guard=threading.Lock())
    with pytest.raises(colocar.SerializationError, match=r"result of .*make_lock") as info:
        make_lock.on(host)()
    assert "_thread.lock" in str(info.value)
    # the cluster keeps working, both hosts
    assert echo.on(cluster.hosts)(1, x=2) == [((1,), {"x": 2})] * 2


# --- 3. modules the sidecar cannot import -------------------------------------------------------
def test_missing_module_is_named_and_ship_modules_fixes_it(tmp_path, make_cluster):
    name = f"colocar_test_shipped_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text("def triple(x):\n    return 3 * x\n")
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp_path))  # the controller sends its sys.path at connect
    try:
        c = make_cluster()
        host = c.hosts[0]
        plain = colocar.colocated(module.triple)
        with pytest.raises(Exception, match=name) as info:
            plain.on(host)(2)
        assert "ship_modules" in str(info.value)
        assert info.value.colocar_host == host.name
        shipped = colocar.colocated(module.triple, ship_modules=[module])
        assert shipped.on(host)(2) == 6
        with pytest.raises(Exception, match=name):  # the failed load was not cached as a success
            plain.on(host)(2)
    finally:
        sys.modules.pop(name, None)


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
    arena = os.path.basename(c.hosts[0].connection.info.arena_path)
    assert arena in arena_files(shm_dir)
    _lost_mid_call(c, tmp_path, signal.SIGKILL)
    assert arena in arena_files(shm_dir)  # a killed sidecar cannot clean up ...
    c.close()
    assert arena not in arena_files(shm_dir)  # ... so close() does


def test_sigstop_mid_call_raises_host_lost(make_cluster, tmp_path, shm_dir):
    c = make_cluster()
    arena = os.path.basename(c.hosts[0].connection.info.arena_path)
    try:
        _lost_mid_call(c, tmp_path, signal.SIGSTOP)
    finally:
        os.kill(c.processes[0].pid, signal.SIGCONT)
        c.processes[0].kill()
    c.close()
    assert arena not in arena_files(shm_dir)


# --- 6./7. sessions: a killed controller's lease, an explicit close -----------------------------
CONTROLLER_SCRIPT = r"""
import sys, time
import numpy as np
import colocar

address, token_file, ready = sys.argv[1:4]
with open(token_file) as f:
    token = f.read().strip()
cluster = colocar.connect([address], token=token, lease_seconds=2, heartbeat_seconds=0.5)
host = cluster.hosts[0]

@colocar.colocated_class
class Holder:
    def __init__(self, nbytes):
        self.array = colocar.shm.empty((nbytes,), np.uint8)
        self.array[:] = 1

    def size(self):
        return self.array.nbytes

holders = [Holder.on(host)(1 << 20)] + [Holder.on(host)(64) for _ in range(3)]
staged = host.connection.empty([((1 << 20,), np.uint8)])
assert holders[0].size() == 1 << 20
with open(ready, "w") as f:
    f.write("READY")
print("READY", flush=True)
time.sleep(600)
"""


def test_killed_controller_frees_its_objects_after_the_lease(make_cluster, tmp_path):
    c = make_cluster(persist=False, lease_seconds=2)
    host = c.hosts[0]
    base_objects, base_sessions, base_used = usage(host)
    ready = tmp_path / "ready"
    log = open(tmp_path / "controller.log", "wb")
    controller = subprocess.Popen(
        [sys.executable, "-c", CONTROLLER_SCRIPT, host.address, c.token_file, str(ready)],
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
        staged = conn.empty([((MiB,), np.uint8)])
        objects, sessions, used = usage(host)
        assert (objects, sessions) == (base[0] + 2, base[1] + 1) and used >= base[2] + 2 * MiB
    finally:
        conn.close()
    wait_for(lambda: usage(host) == base, "Disconnect to free the objects", timeout=10)
    del holders, staged

    # a whole cluster from connect()
    other = colocar.connect([host.address], token=token, devices=[[]], lease_seconds=120)
    try:
        holder = Holder.on(other.hosts[0])(MiB)
        assert usage(host)[:2] == (base[0] + 1, base[1] + 1)
    finally:
        other.close()
    wait_for(lambda: usage(host) == base, "cluster.close() to free the objects", timeout=10)
    del holder


# --- 8. full pools ------------------------------------------------------------------------------
def test_full_pool_waits_then_explains(make_cluster):
    c = make_cluster(arena_size=16 * MiB, pools={"ckpt": 4 * MiB}, alloc_timeout=1)
    host = c.hosts[0]
    conn = host.connection
    assert conn.alloc_timeout == 1
    reserved = host.stats()["pools"]["default"]["reserved"]
    assert 8 * MiB < reserved < 12 * MiB

    # controller-side allocation in the default pool
    (big,) = conn.empty([((8 * MiB,), np.uint8)])
    big[:] = 5
    with pytest.raises(ArenaFullError) as info:
        conn.empty([((8 * MiB,), np.uint8)])
    message = str(info.value)
    assert "'default'" in message and "Release" in message and host.name in message
    # a call whose argument needs room also fails cleanly
    with pytest.raises(ArenaFullError, match="'default'"):
        arena_sum.on(host)(np.ones(8 * MiB, np.uint8))

    # sidecar-side allocation in the ckpt pool
    hog = Holder.on(host)(3 * MiB, "ckpt")
    with pytest.raises(ArenaFullError) as info:
        hog.grab(3 * MiB, "ckpt")
    assert "'ckpt'" in str(info.value) and "raise the size of pool 'ckpt'" in str(info.value)
    assert info.value.colocar_host == host.name
    # a full ckpt pool does not stop default-pool calls (once the default pool has room)
    del big
    wait_for(lambda: usage(host)[2] == 0, "the controller's block to be released")
    assert arena_sum.on(host)(np.ones(4 * MiB, np.uint8)) == 4 * MiB
    out = make_array.on(host)(2 * MiB, 9)
    assert out.shape == (2 * MiB,) and int(out[-1]) == 9
    del out

    # a waiting allocation gets the room freed while it waits
    conn.alloc_timeout = DEADLINE
    (first,) = conn.empty([((8 * MiB,), np.uint8)])
    box: list[Any] = []
    waiter = threading.Thread(target=lambda: box.append(conn.empty([((6 * MiB,), np.uint8)])), daemon=True)
    waiter.start()
    del first
    waiter.join(DEADLINE)
    assert box and box[0][0].nbytes == 6 * MiB
    box.clear()

    # nothing is corrupted, and after freeing, ckpt allocations work again
    assert hog.check()
    with pytest.raises(ArenaFullError, match="'ckpt'"):
        make_array.on(host)(3 * MiB, 4, pool="ckpt")
    hog.drop()
    out = make_array.on(host)(3 * MiB, 4, pool="ckpt")
    assert out.shape == (3 * MiB,) and int(out[0]) == int(out[-1]) == 4
    assert host.stats()["pools"]["ckpt"]["used"] >= 3 * MiB
    del out
    assert hog.grab(MiB, "ckpt") == 1 and hog.check()


# --- 9. timeouts and cancellation ---------------------------------------------------------------
def test_per_call_timeout(cluster, tmp_path):
    host = cluster.hosts[0]
    started, stop = tmp_path / "started", tmp_path / "stop"
    try:
        with pytest.raises(colocar.CallTimeoutError) as info:
            wait_with_timeout.on(host)(str(started), str(stop))
        assert isinstance(info.value, TimeoutError) and host.name in str(info.value)
        assert started.exists()
    finally:
        stop.touch()  # lets the remote function end
    assert sidecar_pid.on(host)() > 0


def test_cancel_queued_call(cluster, tmp_path):
    host = cluster.hosts[1]
    counter = Counter.on(host)()
    started, stop = tmp_path / "started", tmp_path / "stop"
    try:
        slow = mark_and_wait.on(host).submit(str(started), str(stop))
        queued = counter.bump.submit()
        after = counter.value.submit()  # program order: sent after `queued` would have completed
        wait_for(started.exists, "the slow call to start")
        assert queued.cancel() is True
    finally:
        stop.touch()
    assert slow.result(DEADLINE) is True
    assert after.result(DEADLINE) == 0
    with pytest.raises(CancelledError):
        queued.result(DEADLINE)
    assert counter.bump() == 1


# --- 10. graceful shutdown ----------------------------------------------------------------------
def test_sigterm_drains_in_flight_calls(make_cluster, tmp_path, shm_dir):
    c = make_cluster()
    host, process = c.hosts[0], c.processes[0]
    arena = os.path.basename(host.connection.info.arena_path)
    future = mark_and_sleep.on(host).submit(str(tmp_path / "started"), 2)
    wait_for((tmp_path / "started").exists, "the call to start")
    process.send_signal(signal.SIGTERM)
    assert future.result(DEADLINE) == 2
    assert process.wait(DEADLINE) == 0
    assert arena not in arena_files(shm_dir)


# --- 11. seeded kills during a stream of calls --------------------------------------------------
def _kill_during_stream(seed: int, make_cluster: Callable[..., Any]) -> None:
    rng = random.Random(seed)
    c = make_cluster(hosts=2, processes=1)
    victim = rng.randrange(2)
    hosts = c.hosts
    counters = [Counter.on(h)() for h in hosts]
    payload = np.arange(64 * 1024, dtype=np.float32)
    kinds = ["sync", "submit", "both", "array", "method", "worker", "sleep"]
    outcomes: list[tuple[int, str, str, BaseException | None]] = []
    outcomes_lock = threading.Lock()
    stop = threading.Event()

    def stream(thread_seed: int) -> None:
        r = random.Random(thread_seed)
        while not stop.is_set():
            i = r.randrange(2)
            kind = r.choice(kinds)
            error: BaseException | None = None
            try:
                if kind == "sync":
                    assert sidecar_pid.on(hosts[i])() > 0
                elif kind == "submit":
                    futures = [echo.on(hosts[i]).submit(k) for k in range(r.randint(1, 4))]
                    assert [f.result(DEADLINE)[0] for f in futures] == [(k,) for k in range(len(futures))]
                elif kind == "both":
                    i = victim
                    assert len(sidecar_pid.on(hosts)()) == 2
                elif kind == "array":
                    assert arena_sum.on(hosts[i])(payload) == int(payload.sum())
                elif kind == "method":
                    assert counters[i].bump() > 0
                elif kind == "worker":
                    assert worker_pid.on(hosts[i])() > 0
                else:
                    assert mark_and_sleep.on(hosts[i])(os.devnull, r.uniform(0, 0.05)) >= 0
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
    for i, kind, status, error in outcomes:
        if status == "ok":
            continue
        assert i == victim, f"seed {seed}: {kind} on the surviving host failed: {error!r}"
        assert isinstance(error, colocar.HostLostError), f"seed {seed}: {kind} raised {error!r}"
    assert any(i == victim and status == "error" for i, _, status, _ in outcomes), f"seed {seed}"
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
