"""The ckpt benchmark's measurement of one system in one round (`measure`).

A system (`System`) is driven through save 1 with an idle caller (blocked, durable, memory),
its restore (timed, then checked against the state), and save 2 with the training loop running
until it is durable (the slowdown). The training loop is `step`, a fixed amount of pure Python.
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from colocar.bench.ckpt.memory import Memory

STEP_ITERATIONS = 20_000  # one training "step" of pure Python (~2 ms here)


def step() -> int:
    """One training step: a fixed loop of integer additions."""
    acc = 0
    for i in range(STEP_ITERATIONS):
        acc += i
    return acc


def steps_for(seconds: float) -> float:
    """Mean step time (s) over `seconds` of steps."""
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        step()
        n += 1
    return elapsed / n


def syncfs(path: str) -> float:
    """Flushes the filesystem holding `path` (`syncfs(2)`: every dirty page and directory entry
    of it, then one disk cache flush); returns the seconds. One call whatever the number of files:
    an fsync per file costs a cache flush (~1-2 ms here) even for a clean file, which would
    charge a layout of many files for nothing."""
    libc = ctypes.CDLL(None, use_errno=True)
    start = time.monotonic()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if libc.syncfs(fd) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"syncfs({path}): {os.strerror(errno)}")
    finally:
        os.close(fd)
    return time.monotonic() - start


class System:
    """One checkpointing system as the measurement drives it; `k` names a save (1 or 2)."""

    def save(self, k: int) -> None: ...
    def wait(self) -> None: ...
    def path(self, k: int) -> str:
        raise NotImplementedError

    def restore(self, k: int) -> Any: ...
    def delete(self, k: int) -> None: ...


def check(restored: Any, state: dict[str, Any]) -> None:
    """Restored == saved, same shardings; compared on the devices (np.asarray of a sharded
    array would cache a host copy of it on the array, growing the training process)."""
    import jax
    import jax.numpy as jnp

    equal = jax.jit(lambda a, b: jnp.all(a == b))
    for key, layer in state.items():
        for name, value in layer.items():
            got = restored[key][name]
            if got.sharding != value.sharding or not bool(equal(got, value)):
                raise AssertionError(f"{key}/{name} restored wrong")


def _idle_save(system: System, memory: Memory, state: dict[str, Any]) -> dict[str, float]:
    """Save 1 with an idle caller, then its restore (checked); save 1 is deleted after.
    Returns the timings and the memory peaks (absolute, not less the baseline)."""
    import jax

    gc.collect()
    t0 = time.monotonic()
    system.save(1)
    blocked = time.monotonic() - t0
    system.wait()
    t_done = time.monotonic()
    sync_s = syncfs(system.path(1))
    save_peak = memory.window(t0, t_done)

    t1 = time.monotonic()
    restored = system.restore(1)
    jax.block_until_ready(restored)
    restore_s = time.monotonic() - t1
    restore_peak = memory.window(t1, time.monotonic())
    check(restored, state)
    del restored
    gc.collect()
    system.delete(1)
    return {
        "blocked_s": blocked,
        "durable_s": t_done - t0 + sync_s,
        "syncfs_s": sync_s,
        "restore_s": restore_s,
        "save_peak": save_peak,
        "restore_peak": restore_peak,
    }


def loop_until(done_fn: Callable[[], None]) -> tuple[float, int]:
    """Runs training steps until `done_fn` (called on a second thread) returned; returns the
    loop's seconds and steps. Re-raises what `done_fn` raised."""
    done = threading.Event()
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            done_fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the training thread
            errors.append(e)
        finally:
            done.set()

    thread = threading.Thread(target=waiter, name="bench-wait", daemon=True)
    thread.start()
    n, start = 0, time.perf_counter()
    while not done.is_set():
        step()
        n += 1
    loop_s = time.perf_counter() - start
    thread.join()
    if errors:
        raise errors[0]
    return loop_s, n


def _training_save(system: System) -> tuple[float, int, float]:
    """Save 2, the training loop running from the moment `save` returned until a second thread
    saw the save durable. Returns the loop's seconds, its steps, and the seconds from the save
    call until durable (plus the `syncfs`); save 2 is deleted after."""
    t2 = time.monotonic()
    system.save(2)
    ended: list[float] = []

    def durable() -> None:
        try:
            system.wait()
        finally:
            ended.append(time.monotonic())

    loop_s, n = loop_until(durable)
    durable_training = ended[0] - t2 + syncfs(system.path(2))
    system.delete(2)
    return loop_s, n, durable_training


def measure(
    system: System, memory: Memory, baseline_bytes: float, state: dict[str, Any], baseline_s: float
) -> dict[str, Any]:
    """Save 1 with an idle caller (blocked, durable, memory), its restore (checked), then save 2
    with the training loop running until durable (slowdown against `baseline_s` of steps)."""
    idle = _idle_save(system, memory, state)
    step_s = steps_for(baseline_s)
    loop_s, n, durable_training = _training_save(system)
    return {
        "blocked_s": idle["blocked_s"],
        "durable_s": idle["durable_s"],
        "syncfs_s": idle["syncfs_s"],
        "restore_s": idle["restore_s"],
        "train_slowdown": (loop_s / n) / step_s - 1 if n else 0.0,
        "train_lost_s": loop_s - n * step_s,
        "durable_training_s": durable_training,
        "train_steps": n,
        "step_ms": step_s * 1e3,
        "peak_host_mem": idle["save_peak"] - baseline_bytes,
        "restore_mem": idle["restore_peak"] - baseline_bytes,
    }
