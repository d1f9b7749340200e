"""Ctrl-C never shifts replies, frees the call's lane at once, and leaks nothing.

Each test delivers a real SIGINT to the main thread (where Python raises KeyboardInterrupt)
from a timer thread, at a chosen or seeded random point of a call, a future's wait, a
generator, a loader's start-up or a checkpoint save. After each interruption the next call must
return its own value, quickly, and at the end no arena block, remote call or process is left.
"""

from __future__ import annotations

import functools
import gc
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError
from typing import Any

import jax
import numpy as np
import psutil
import pytest
from helpers import wait_for
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import colocar
from colocar import loaders
from colocar.loaders.sampler import IndexSampler

DEADLINE = 30.0
QUICK = 10.0  # the next call after an interrupted 60 s call must end well within this


# --- delivering the interrupt -------------------------------------------------------------------
def run_interrupted(
    fn: Callable[[], Any], delay: float = 0.0, when: Callable[[], bool] | None = None
) -> tuple[bool, Any]:
    """Runs fn() in the main thread; SIGINT reaches this thread after `delay` s (or once `when()`
    holds) unless fn ended first. Returns (interrupted, value). A signal sent just as fn ended
    lands here too, never in the test's next line."""
    main = threading.main_thread().ident
    assert threading.get_ident() == main, "interrupt tests run in the main thread"
    lock = threading.Lock()
    state = {"over": False, "sent": False}

    def fire() -> None:
        while when is not None and not when():
            if state["over"]:
                return
            time.sleep(0.01)
        with lock:
            if state["over"]:
                return
            state["sent"] = True
        signal.pthread_kill(main, signal.SIGINT)  # type: ignore[arg-type]

    timer = threading.Timer(delay, fire)
    try:
        timer.start()
        try:
            value = fn()
        finally:
            with lock:
                state["over"] = True
            timer.cancel()
        if state["sent"]:  # sent but not yet raised: let it land here, not in the test's next line
            time.sleep(1.0)  # (Python drops a KeyboardInterrupt raised in a GC finalizer: then none)
        return False, value
    except KeyboardInterrupt:
        return True, None


def used(c: Any) -> list[int]:
    """Bytes in use in each host's default pool."""
    return [h.stats()["pools"]["default"]["used"] for h in c.hosts]


def settled(c: Any, baseline: list[int]) -> None:
    """Waits until nothing of the interrupted calls is left: blocks, running calls."""
    gc.collect()
    wait_for(lambda: used(c) == baseline, f"the arena use to return to {baseline} (now {used(c)})")
    wait_for(
        lambda: all(h.stats()["abandoned_calls"] == 0 and h.stats()["in_flight"] == 0 for h in c.hosts),
        "the abandoned calls to end",
    )


# --- shipped code ---------------------------------------------------------------------------------
@colocar.colocated
def ident(x):
    return x


@colocar.colocated
def wait_for_file(path, limit=60.0):
    """Sleeps until `path` exists (at most `limit` s), then returns a value of its own."""
    deadline = time.monotonic() + limit
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    return f"wait_for_file({os.path.basename(path)}) result"


@colocar.colocated(processes=True)
def worker_sleep(started, seconds):
    """Writes its pid to `started`, then sleeps in a worker process."""
    with open(started + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(started + ".tmp", started)
    time.sleep(seconds)
    return "worker_sleep finished"


@colocar.colocated
def shifted(x, k, seconds):
    time.sleep(seconds)
    return x + k


@colocar.colocated(processes=True)
def shifted_in_worker(x, k, seconds):
    time.sleep(seconds)
    return x + k


@colocar.colocated
def shifted_items(x, k, n, seconds):
    for i in range(n):
        time.sleep(seconds)
        yield x + k + i


@colocar.colocated
def plus_one(x):
    return x + 1


# --- the program ----------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_after_ctrl_c_the_next_call_gets_its_own_reply_at_once(transport, cluster, grpc_cluster, tmp_path):
    c = (cluster if transport == "shm" else grpc_cluster).make_current()
    host = c.hosts[0]
    stop = str(tmp_path / "stop")
    baseline = used(c)
    try:
        interrupted, _ = run_interrupted(lambda: wait_for_file.on(host)(stop), 1.0)
        assert interrupted
        started = time.monotonic()
        assert ident.on(host)(1) == 1
        assert ident.on(host)(2) == 2
        assert ident.on(host).submit(3).result(DEADLINE) == 3
        assert time.monotonic() - started < QUICK
        stats = host.stats()
        assert stats["sessions"] >= 1 and "default" in stats["pools"]
        # still sleeping in its thread (which cannot be stopped), holding no lane
        wait_for(lambda: host.stats()["abandoned_calls"] == 1, "the sidecar to count the abandoned call")
    finally:
        open(stop, "w").close()
    settled(c, baseline)


def test_ctrl_c_while_waiting_on_a_future_frees_its_lane(cluster, tmp_path):
    host = cluster.hosts[1]
    stop = str(tmp_path / "stop")
    baseline = used(cluster)
    try:
        future = wait_for_file.on(host).submit(stop)
        interrupted, _ = run_interrupted(future.result, 1.0)
        assert interrupted
        started = time.monotonic()
        assert ident.on(host).submit("next").result(DEADLINE) == "next"  # same thread, same lane
        assert time.monotonic() - started < QUICK
        with pytest.raises(CancelledError):
            future.result(DEADLINE)
    finally:
        open(stop, "w").close()
    settled(cluster, baseline)


def test_cancel_of_a_running_call_frees_its_lane(cluster, tmp_path):
    host = cluster.hosts[0]
    stop = str(tmp_path / "stop")
    baseline = used(cluster)
    try:
        future = wait_for_file.on(host).submit(stop)
        wait_for(lambda: host.stats()["in_flight"] >= 1, "the call to run")
        assert future.cancel() is True
        assert future.cancel() is False  # once
        started = time.monotonic()
        assert ident.on(host).submit(4).result(DEADLINE) == 4
        assert time.monotonic() - started < QUICK
        with pytest.raises(CancelledError):
            future.result()
    finally:
        open(stop, "w").close()
    settled(cluster, baseline)


def _gone(pid: int) -> bool:
    """The process exited (a zombie counts: it runs no more); reaped meanwhile counts too."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("how", ["interrupt", "cancel", "timeout"])
def test_a_call_given_up_in_a_worker_process_is_stopped(how, make_cluster, tmp_path):
    c = make_cluster(processes=1)
    host = c.hosts[0]
    warm, started = str(tmp_path / "warm"), str(tmp_path / "started")
    assert worker_sleep.on(host)(warm, 0) == "worker_sleep finished"  # the pool's one worker is up
    pid = int(open(warm).read())
    fn = worker_sleep.specialize(timeout=2.0) if how == "timeout" else worker_sleep
    if how == "interrupt":
        interrupted, _ = run_interrupted(
            lambda: fn.on(host)(started, 60), when=lambda: os.path.exists(started)
        )
        assert interrupted
    elif how == "cancel":
        future = fn.on(host).submit(started, 60)
        wait_for(lambda: os.path.exists(started), "the worker call to start")
        assert future.cancel()
    else:
        with pytest.raises(colocar.CallTimeoutError):
            fn.on(host)(started, 60)
    assert int(open(started).read()) == pid
    wait_for(lambda: _gone(pid), "the worker to stop")
    assert fn.on(host)(warm, 0) == "worker_sleep finished"  # in a new worker
    assert int(open(warm).read()) != pid
    wait_for(lambda: host.stats()["abandoned_calls"] == 0, "no abandoned call")


def test_an_interrupted_generator_is_closed_and_frees_its_items(cluster):
    host = cluster.hosts[0]
    baseline = used(cluster)
    x = np.arange(64 * 1024, dtype=np.int64)
    items = shifted_items.on(host)(x, 10, 1000, 0.05)
    assert int(next(items)[0]) == 10
    interrupted, _ = run_interrupted(functools.partial(list, items), 0.5)
    assert interrupted
    with pytest.raises(colocar.ColocarError, match="interrupt"):
        next(items)
    assert int(shifted.on(host)(x, 5, 0)[-1]) == x[-1] + 5
    del items
    settled(cluster, baseline)


# --- signals at random points -------------------------------------------------------------------
KINDS = ("sync", "submit", "worker", "generator", "array", "stats")


def _one_call(kind: str, c: Any, host: Any, x: np.ndarray, k: int, seconds: float) -> Any:
    """One call of the given kind; returns x + k computed remotely (or x + k for `stats`)."""
    if kind == "sync":
        return shifted.on(host)(x, k, seconds)
    if kind == "submit":
        return shifted.on(host).submit(x, k, seconds).result()
    if kind == "worker":
        return shifted_in_worker.on(host)(x, k, seconds)
    if kind == "generator":
        return list(shifted_items.on(host)(x, k, 3, seconds))[-1] - 2
    if kind == "array":  # on every host, as a global jax.Array
        xs = jax.device_put(np.tile(x, 8), NamedSharding(c.mesh(("data",)), P("data")))
        out = np.asarray(plus_one(xs))
        assert (out == np.tile(x, 8) + 1).all(), "an array call gave a wrong value"
        return x + k
    host.stats()
    return x + k


def _interrupt_at_random(seed: int, c: Any, cases: int) -> None:
    """Seeded calls of every kind, each interrupted at a random point (or not at all); after
    each, fresh calls must return their own values; at the end nothing may be left."""
    rng = random.Random(seed)
    baseline = used(c)
    for case in range(cases):
        host = rng.choice(c.hosts)
        k = seed * 1000 + case
        x = np.arange(rng.choice([8, 64 * 1024]), dtype=np.int32)
        kind = rng.choice(KINDS)
        call = functools.partial(_one_call, kind, c, host, x, k, rng.choice([0.0, 0.0, 0.01, 0.05]))
        interrupted, value = run_interrupted(call, rng.uniform(0, 0.1))
        where = f"seed {seed} case {case} ({kind}, interrupted: {interrupted})"
        if not interrupted:
            assert (np.asarray(value) == x + k).all(), f"{where}: a wrong value"
        del value
        for h in c.hosts:  # whatever happened, the next calls get their own replies
            assert ident.on(h)(("own", k)) == ("own", k), where
            assert int(shifted.on(h)(x, -k, 0)[-1]) == x[-1] - k, where
            assert h.stats()["sessions"] >= 1, where
    assert baseline == [0, 0]
    _freed_with_the_session(c)


def _freed_with_the_session(c: Any) -> None:
    """Nothing outlives the controller's session: once it closed, a second controller sees
    every arena empty. (A signal that lands between two bytecodes of a reply's hand-off can
    still strand that reply's blocks until then: a known window, never a wrong value.)"""
    with open(c.token_file) as f:
        token = f.read().strip()
    observer = colocar.connect([h.address for h in c.hosts], token=token, shm=False)
    try:
        c.close()
        wait_for(lambda: used(observer) == [0] * len(observer.hosts), "every arena to be empty")
    finally:
        observer.close()


@pytest.mark.parametrize("seed", [0, 1])
def test_interrupts_at_random_points(seed, make_cluster):
    _interrupt_at_random(seed, make_cluster(hosts=2, processes=1, persist=True), cases=25)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2, 22))
def test_interrupts_at_random_points_many_seeds(seed, make_cluster):
    _interrupt_at_random(seed, make_cluster(hosts=2, processes=1, persist=True), cases=60)


# --- loader start-up and checkpoint saves -------------------------------------------------------
def features(record):
    i = int(record["index"])
    return {"x": np.full((3,), i, np.float32), "label": np.int32(i)}


PIPELINE = {
    "source": {"kind": "range", "n": 64},
    "global_batch_size": 8,
    "transforms": [{"kind": "map", "fn": features}],
    "seed": 3,
    "num_epochs": 1,
    "workers_per_host": 1,
}


def first_batch_is_right(c: Any) -> None:
    with loaders.load(PIPELINE, c) as it:
        labels = np.asarray(next(it)["label"]).tolist()
    assert labels == IndexSampler(64, 8, seed=3, num_epochs=1).batch_indices(0).tolist()


def sidecar_descendants(c: Any) -> set[int]:
    pids = set()
    for process in c.processes:
        for child in psutil.Process(process.pid).children(recursive=True):
            try:
                if child.status() != psutil.STATUS_ZOMBIE:
                    pids.add(child.pid)
            except psutil.Error:
                pass
    return pids


def _interrupt_loader_start(seed: int, c: Any, cases: int) -> None:
    rng = random.Random(seed)
    first_batch_is_right(c)  # starts the forkservers: part of the baseline
    gc.collect()
    baseline, processes = used(c), sidecar_descendants(c)
    for _ in range(cases):
        interrupted, it = run_interrupted(lambda: loaders.load(PIPELINE, c), rng.uniform(0, 1.5))
        if it is not None:
            it.close()
        del it
        first_batch_is_right(c)
    settled(c, baseline)
    wait_for(lambda: sidecar_descendants(c) == processes, "the pipeline workers to exit")


def test_interrupted_loader_start_up(make_cluster):
    _interrupt_loader_start(0, make_cluster(hosts=2, processes=0, arena_size=32 << 20), cases=3)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 6))
def test_interrupted_loader_start_up_many_seeds(seed, make_cluster):
    _interrupt_loader_start(seed, make_cluster(hosts=2, processes=0, arena_size=32 << 20), cases=8)


def _interrupt_saves(seed: int, c: Any, directory: str, cases: int) -> None:
    from colocar.checkpoint import CheckpointManager

    rng = random.Random(seed)
    mesh = c.mesh(("data",))
    sharding = NamedSharding(mesh, P("data"))
    baseline = used(c)
    mngr = CheckpointManager(directory, c, stale_seconds=0.5)
    try:
        for step in range(cases):
            state = {"w": jax.device_put(np.full((256, 1024), step, np.float32), sharding), "step": step}
            run_interrupted(functools.partial(mngr.save, 2 * step, state), rng.uniform(0, 0.3))
            assert mngr.save(2 * step + 1, state)  # the next save works, and saves its own state
            mngr.wait()
            restored = mngr.restore(2 * step + 1, target={"w": state["w"], "step": 0})
            assert restored["step"] == step
            assert (np.asarray(restored["w"]) == step).all()
            del state, restored
    finally:
        mngr.close()
    settled(c, baseline)


def test_interrupted_checkpoint_saves(make_cluster, tmp_path):
    _interrupt_saves(0, make_cluster(hosts=2, processes=0, arena_size=32 << 20), str(tmp_path / "c"), 3)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 6))
def test_interrupted_checkpoint_saves_many_seeds(seed, make_cluster, tmp_path):
    _interrupt_saves(seed, make_cluster(hosts=2, processes=0, arena_size=32 << 20), str(tmp_path / "c"), 8)
