"""A large array out of a sidecar through the shared-memory arena, against a local memcpy.

`gbps`: a float32 array (256 MiB; 64 MiB with --quick) is produced on the sidecar by ONE copy
from a warm source (kept in this module's `_CACHE` on the sidecar) into an arena block
(`colocar.shm.empty` + `np.copyto`), and returned; timed from the call until the controller
holds a numpy array of it (a zero-copy view of the block). `memcpy_gbps`: `np.copyto` of the
same size between two warm buffers in the controller, measured in the same rounds (interleaved).
`ratio` = gbps / memcpy_gbps: what the call adds to the one copy that cannot be avoided.

Zero-copy paths, reported apart: `view_ms` (the function hands over an arena array it prepared
earlier and no longer keeps: no copy anywhere, only the call and the descriptor; an array it kept
would be copied, since it could still write it) and `device_put_ms` (the received
view put on a JAX CPU device; `device_put_aliased` says whether JAX kept the arena's memory
instead of copying, by comparing `unsafe_buffer_pointer()` with the view's data pointer).

On a machine with an accelerator, `accel_put_gbps` puts the received arena view on it and
`accel_put_plain_gbps` a warm numpy array of the same size (the peer: what a trainer's own
buffer costs); `accel_put_ratio` is the first over the second.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from colocar.jax_compat import collect_garbage

MiB = 1 << 20
_CACHE: dict[str, Any] = {}  # on the sidecar: warm source and held arena array


# --- shipped to the sidecar ----------------------------------------------------------------
def _source(n: int) -> np.ndarray:
    src = _CACHE.get("source")
    if src is None or src.size != n:
        src = np.arange(n, dtype=np.float32)  # written once: every page is resident (warm)
        _CACHE["source"] = src
        _CACHE["source_builds"] = _CACHE.get("source_builds", 0) + 1
    return src


def produce(n: int) -> np.ndarray:
    """One copy, warm source -> arena; returning the arena array copies nothing more."""
    import colocar

    src = _source(n)
    out = colocar.shm.empty(src.shape, src.dtype)
    np.copyto(out, src)
    return out


def hold(n: int) -> int:
    """Prepares an arena array on the sidecar (for the zero-copy view path)."""
    import colocar

    held = colocar.shm.empty((n,), np.float32)
    np.copyto(held, _source(n))
    _CACHE["held"] = held
    return _CACHE["source_builds"]


def view() -> np.ndarray:
    return _CACHE.pop("held")  # handed over: the sidecar no longer reaches it, so no copy


def forget() -> int:
    _CACHE.pop("held", None)
    return int(_CACHE.get("source_builds", 0))


# --- controller ----------------------------------------------------------------------------
def _wait_used(host: Any, at_most: int, timeout: float = 10.0) -> None:
    """Waits until the sidecar's arena has at most `at_most` bytes in use (releases are async)."""
    deadline = time.monotonic() + timeout
    while True:
        used = sum(p["used"] for p in host.stats()["pools"].values())
        if used <= at_most or time.monotonic() > deadline:
            return
        time.sleep(0.005)


def _collect() -> None:
    collect = collect_garbage()
    if collect is not None:
        collect()


def _put_seconds(array: np.ndarray, device: Any) -> float:
    import jax

    t0 = time.perf_counter()
    jax.device_put(array, device).block_until_ready()
    return time.perf_counter() - t0


def _accel_figures(med: dict[str, float], nbytes: int, accel: Any) -> dict:
    view, plain = nbytes / med["accel"] / 1e9, nbytes / med["accel_plain"] / 1e9
    return {
        "accelerator": str(accel.device_kind),
        "accel_put_gbps": round(view, 2),
        "accel_put_plain_gbps": round(plain, 2),
        "accel_put_ratio": round(view / plain, 3),
    }


def _one_round(
    host: Any,
    fns: dict[str, Any],
    n: int,
    buffers: tuple[np.ndarray, np.ndarray],
    baseline: int,
    devices: tuple,
) -> tuple[dict[str, float], bool]:
    """One round: an array produced out of the sidecar, the local memcpy of `buffers` (src,
    dst), the held view and its `device_put` on `devices[0]` (the CPU), and the accelerator
    puts if `devices[1]` is one. Returns the timings by name and whether JAX aliased the view."""
    import jax

    (src, dst), (cpu, accel) = buffers, devices
    t0 = time.perf_counter()
    out = fns["produce"].on(host)(n)
    t1 = time.perf_counter()
    assert isinstance(out, np.ndarray) and out.shape == (n,) and out[-1] == n - 1
    del out
    _wait_used(host, baseline)

    t2 = time.perf_counter()
    np.copyto(dst, src)
    t3 = time.perf_counter()

    fns["hold"].on(host)(n)
    t4 = time.perf_counter()
    held = fns["view"].on(host)()
    t5 = time.perf_counter()
    on_device = jax.device_put(held, cpu)
    on_device.block_until_ready()
    t6 = time.perf_counter()
    aliased = on_device.unsafe_buffer_pointer() == held.ctypes.data
    times = {"call": t1 - t0, "memcpy": t3 - t2, "view": t5 - t4, "device_put": t6 - t5}
    if accel is not None:
        times["accel"] = _put_seconds(held, accel)
        times["accel_plain"] = _put_seconds(src, accel)
    del on_device, held
    _collect()  # JAX frees an aliased buffer at its own collection, not at `del`
    _wait_used(host, baseline)
    return times, aliased


def _summary(
    quick: bool,
    nbytes: int,
    rounds: int,
    times: dict[str, list[float]],
    aliased: bool,
    source_builds: int,
    accel: Any,
) -> dict:
    """The result: medians over the timed rounds, in the order the table prints them."""
    n = nbytes // 4
    med = {k: statistics.median(v) for k, v in times.items() if v}
    gbps = nbytes / med["call"] / 1e9
    memcpy_gbps = nbytes / med["memcpy"] / 1e9
    return {
        "benchmark": "transfer",
        "quick": quick,
        "array_mib": nbytes // MiB,
        "array": f"float32[{n}] ({nbytes // MiB} MiB{', smaller: --quick' if quick else ''})",
        "rounds": rounds,
        "gbps": round(gbps, 2),
        "memcpy_gbps": round(memcpy_gbps, 2),
        "ratio": round(gbps / memcpy_gbps, 3),
        "call_ms": round(med["call"] * 1e3, 2),
        "memcpy_ms": round(med["memcpy"] * 1e3, 2),
        "view_ms": round(med["view"] * 1e3, 3),
        "view_gbps": round(nbytes / med["view"] / 1e9, 1),
        "device_put_ms": round(med["device_put"] * 1e3, 3),
        "device_put_aliased": aliased,
        "source_builds": source_builds,
        **(_accel_figures(med, nbytes, accel) if accel is not None else {}),
        "call_ms_per_round": [round(t * 1e3, 2) for t in times["call"]],
        "memcpy_ms_per_round": [round(t * 1e3, 2) for t in times["memcpy"]],
    }


def run(quick: bool, repeats: int) -> dict:
    """Rounds of `_one_round` on one local sidecar (round 0 warms up and is not timed)."""
    import jax

    import colocar

    nbytes = (64 if quick else 256) * MiB
    n = nbytes // 4
    rounds = max(3, repeats)
    cpu = jax.devices("cpu")[0]
    accel = jax.devices()[0] if jax.default_backend() != "cpu" else None
    fns = {f.__name__: colocar.colocated(f) for f in (produce, hold, view, forget)}

    src = np.arange(n, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # both warm

    names = ("call", "memcpy", "view", "device_put", "accel", "accel_plain")
    times: dict[str, list[float]] = {name: [] for name in names}
    aliased: list[bool] = []
    with colocar.local_cluster(hosts=1, arena_size=4 * nbytes + 64 * MiB, processes=0) as cluster:
        host = cluster.hosts[0]
        if not host.shm:
            raise RuntimeError("the controller cannot map the sidecar's arena: no zero-copy path")
        baseline = sum(p["used"] for p in host.stats()["pools"].values())
        for r in range(rounds + 1):  # round 0 warms the arena pages and the code cache
            got, alias = _one_round(host, fns, n, (src, dst), baseline, (cpu, accel if r > 0 else None))
            aliased.append(alias)
            if r > 0:
                for name, seconds in got.items():
                    times[name].append(seconds)
        source_builds = fns["forget"].on(host)()

    return _summary(quick, nbytes, rounds, times, all(aliased), source_builds, accel)
