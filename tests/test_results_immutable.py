"""A returned array never changes: results that the sidecar can still reach are copied.

The programs keep what they return (an object's state, a cache, a generator's buffer) and
write it again in a later call; the earlier result must keep its value. Values are read with
`jnp`, never `np.asarray` (JAX caches a numpy read, which would hide aliasing).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import wait_for
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import colocar
from colocar.shm import ArenaFullError
from colocar.shm.context import sidecar_runtime

N = 1 << 15  # 128 KiB of float32: large enough to travel through arena blocks


def _first_device_array(cluster, values: np.ndarray) -> jax.Array:
    return jax.device_put(values, cluster.hosts[0].devices[0])


class Accumulator:
    """The issue's program: keeps its first input and adds later ones in place."""

    def __init__(self):
        self.total = None

    def add(self, x):
        if self.total is None:
            self.total = x
        else:
            self.total += x
        return self.total


def _caching_function():
    """A plain function with a cache that outlives its calls (its own, per test)."""
    cache = {}

    def cached(x):
        if "total" not in cache:
            cache["total"] = x
        else:
            cache["total"] += x
        return cache["total"]

    return cached


def _reusing_function():
    """Returns the same arena buffer every call, refilled: zero-copy would be wrong here."""
    buffers = []

    def fill(x):
        if not buffers:
            buffers.append(colocar.shm.empty(x.shape, x.dtype))
        buffers[0][:] = x * 2
        return buffers[0]

    return fill


def _check_first_result_kept(call, x):
    expected = float(jnp.sum(x))
    first = call(x)
    assert float(jnp.sum(first)) == expected
    second = call(x)
    assert float(jnp.sum(second)) == 2 * expected
    assert float(jnp.sum(first)) == expected, "a returned jax.Array changed after a later call"


def test_a_kept_input_does_not_change_an_objects_returned_array(cluster):
    x = _first_device_array(cluster, np.arange(N, dtype=np.float32))
    accumulator = colocar.colocated_class(Accumulator)()
    _check_first_result_kept(accumulator.add, x)


def test_a_cached_input_does_not_change_a_functions_returned_array(cluster):
    x = _first_device_array(cluster, np.arange(N, dtype=np.float32))
    _check_first_result_kept(colocar.colocated(_caching_function()), x)


def test_a_reused_arena_buffer_does_not_change_a_returned_array(cluster):
    x = _first_device_array(cluster, np.ones(N, np.float32))
    fill = colocar.colocated(_reusing_function())
    first = fill(x)
    second = fill(x * 3)
    assert float(jnp.sum(first)) == 2 * N
    assert float(jnp.sum(second)) == 6 * N


@pytest.mark.parametrize("program", ["cache", "reused buffer"])
def test_worker_results_never_change(make_cluster, program):
    cluster = make_cluster(processes=1)  # one worker: every call meets the same cache
    x = _first_device_array(cluster, np.arange(N, dtype=np.float32))
    if program == "cache":
        _check_first_result_kept(colocar.colocated(_caching_function(), processes=True), x)
    else:
        fill = colocar.colocated(_reusing_function(), processes=True)
        first = fill(x)
        fill(x * 3)
        assert float(jnp.sum(first)) == 2 * float(jnp.sum(x))


def test_generator_items_never_change(cluster):
    @colocar.colocated
    def countdown(n):
        buffer = colocar.shm.empty((N,), np.float32)
        for i in range(n):
            buffer[:] = i  # refilled after the previous item went out
            yield buffer

    items = list(countdown.on(cluster.hosts[0])(3))
    assert [float(item[0]) for item in items] == [0.0, 1.0, 2.0]
    assert [float(item.sum()) for item in items] == [0.0, N, 2.0 * N]


def _arena_offset(cluster, array: jax.Array) -> int:
    arena = cluster.hosts[0].connection.blocks.arena
    return array.unsafe_buffer_pointer() - arena.base_address


def test_a_fresh_arena_result_is_not_copied_but_a_kept_one_is(cluster):
    """The safe zero-copy path stays: a `colocar.shm.empty` result nothing else holds."""
    x = _first_device_array(cluster, np.ones(N, np.float32))

    def make_double(keep: bool):
        kept = []

        def double(x):
            out = colocar.shm.empty(x.shape, x.dtype)
            out[:] = x * 2
            if keep:
                kept.append(out)
            base = sidecar_runtime().arena.base_address
            offset = out.__array_interface__["data"][0] - base
            return out, offset

        return colocar.colocated(double)

    fresh, fresh_offset = make_double(keep=False)(x)
    kept, kept_offset = make_double(keep=True)(x)
    assert _arena_offset(cluster, fresh) == fresh_offset  # the function's own block
    assert _arena_offset(cluster, kept) != kept_offset  # a copy: the sidecar may write its block
    assert float(jnp.sum(fresh)) == float(jnp.sum(kept)) == 2 * N


def test_a_worker_keeps_its_views_valid_and_frees_them_once_dropped(make_cluster):
    """A worker's view kept across calls holds its block: later calls cannot reuse the memory."""
    cluster = make_cluster(processes=1)
    host = cluster.hosts[0]
    kept = []

    @colocar.colocated(processes=True)
    def keep_first(x, drop=False):
        if drop:
            kept.clear()
            return 0.0
        if not kept:
            kept.append(x)
        return float(kept[0].sum())

    def used() -> int:
        return host.stats()["pools"]["default"]["used"]

    baseline = used()
    for k in range(1, 6):  # each call's input block would reuse the first one's memory
        assert keep_first.on(host)(np.full(N, k, np.float32)) == N
    assert used() > baseline  # the kept view's block is still leased
    keep_first.on(host)(np.zeros(1), drop=True)
    keep_first.on(host)(np.zeros(1))  # the next reply tells the sidecar the view is gone
    keep_first.on(host)(np.zeros(1), drop=True)
    wait_for(lambda: used() == baseline, "the kept block to be freed")


@pytest.mark.parametrize("processes", [False, True], ids=["thread", "worker"])
def test_a_result_larger_than_the_arena_raises_arena_full(make_cluster, processes):
    cluster = make_cluster(arena_size=8 << 20)
    host = cluster.hosts[0]

    @colocar.colocated(processes=processes)
    def too_big():
        return np.zeros(16 << 20, np.uint8)

    baseline = host.stats()["pools"]["default"]["used"]
    with pytest.raises(ArenaFullError, match="pool 'default' cannot hold 16777216 bytes"):
        too_big.on(host)()
    assert host.stats()["pools"]["default"]["used"] == baseline


def test_zero_d_results_are_jax_arrays(cluster):
    x = jax.device_put(np.array(1, np.int32), cluster.hosts[0].devices[0])
    y = colocar.colocated(lambda x: x + 1)(x)
    assert isinstance(y, jax.Array)
    assert y.dtype == np.int32 and int(jnp.asarray(y)) == 2

    replicated = jax.device_put(np.float32(3.0), NamedSharding(cluster.mesh(("data",)), P()))
    z = colocar.colocated(lambda x: x * 2)(replicated)
    assert isinstance(z, jax.Array)
    assert z.sharding == replicated.sharding
    assert float(jnp.asarray(z)) == 6.0
