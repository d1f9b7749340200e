"""Array calls stage their hosts at once, and one host inline; a failure leaves nothing behind.

Staging a host is copying its blocks of the array arguments into its arena and building its
call (pickling the arguments). A probe argument records, while it is pickled, which thread
staged it, and can hold every staging until all hosts are being staged at once.
"""

from __future__ import annotations

import gc
import sys
import threading

import jax
import numpy as np
import pytest
from helpers import wait_for
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import colocar
from colocar.checkpoint import CheckpointManager
from colocar.shm import ArenaFullError

MiB = 1 << 20


class Probe:
    """Pickles as 0, noting the thread that pickled it; with a barrier, waits for the others."""

    def __init__(self, barrier: threading.Barrier | None = None):
        self.barrier = barrier
        self.threads: list[str] = []

    def __reduce__(self):
        self.threads.append(threading.current_thread().name)
        if self.barrier is not None:
            self.barrier.wait()  # broken (an error) unless every host is staged at once
        return (int, (0,))


def plus(x, k):
    return x + k


def _allocated(cluster) -> list[int]:
    """Bytes every host's default pool ever carved (grows with each block allocated)."""
    return [h.stats()["pools"]["default"]["allocated"] for h in cluster.hosts]


def test_hosts_are_staged_at_once(cluster):
    values = np.arange(32768.0)  # 128 KiB a host: blocks in the arenas
    x = jax.device_put(values, NamedSharding(cluster.mesh(("data",)), P("data")))
    probe = Probe(threading.Barrier(len(cluster.hosts), timeout=20))
    before = _allocated(cluster)
    y = colocar.colocated(plus)(x, probe)
    np.testing.assert_array_equal(np.asarray(y), values)
    assert len(probe.threads) == 2
    assert all(name.startswith("colocar-staging") for name in probe.threads), probe.threads
    assert all(a > b for a, b in zip(_allocated(cluster), before, strict=True))


def test_small_arguments_are_staged_on_the_callers_thread_without_a_block(cluster):
    """A host's part under the pickling threshold travels in its request: no Allocate round
    trip, no staging thread (either costs more than copying a few KiB)."""
    values = np.arange(64.0).reshape(16, 4)
    x = jax.device_put(values, NamedSharding(cluster.mesh(("data",)), P("data")))
    probe = Probe()
    before = _allocated(cluster)
    y = colocar.colocated(plus)(x, probe)
    np.testing.assert_array_equal(np.asarray(y), values)
    assert probe.threads == [threading.current_thread().name] * len(cluster.hosts)
    assert _allocated(cluster) == before


def test_a_large_numpy_argument_beside_small_parts_is_staged_at_once(cluster):
    """Its copy into each host's arena (an Allocate each) runs on every host at once."""
    x = jax.device_put(np.arange(16.0), NamedSharding(cluster.mesh(("data",)), P("data")))
    table = np.ones(1 << 16)  # 512 KiB: a block per host
    probe = Probe(threading.Barrier(len(cluster.hosts), timeout=20))
    y = colocar.colocated(plus_sum)(x, probe, table)
    np.testing.assert_array_equal(np.asarray(y), np.arange(16.0) + table.sum())
    assert all(name.startswith("colocar-staging") for name in probe.threads), probe.threads


def plus_sum(x, k, table):
    return x + k + table.sum()


def test_one_host_is_staged_on_the_callers_thread(cluster):
    devices = cluster.hosts[0].devices
    mesh = jax.sharding.Mesh(np.array(devices, dtype=object), ("data",))
    x = jax.device_put(np.arange(8.0), NamedSharding(mesh, P("data")))
    probe = Probe()
    y = colocar.colocated(plus)(x, probe)
    np.testing.assert_array_equal(np.asarray(y), np.arange(8.0))
    assert probe.threads == [threading.current_thread().name]


def test_new_arrays_staged_on_two_threads_get_every_block(cluster):
    """Each host's staging thread reads the array's shards; JAX breaks the shard list of an
    array first read from two threads at once (likely with a tiny switch interval). The plan
    reads it once, on the caller's thread: every call gets every block."""
    mesh = cluster.mesh(("data",))
    call = colocar.colocated(plus)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for width in range(1, 41):  # new shard shapes: JAX's shape caches miss, as in a new program
            x = jax.device_put(np.arange(8.0 * width).reshape(8, width), NamedSharding(mesh, P("data")))
            y = call(x, 1)
            np.testing.assert_array_equal(np.asarray(y), np.arange(8.0 * width).reshape(8, width) + 1)
    finally:
        sys.setswitchinterval(interval)


def test_a_broken_shard_list_kept_by_jax_is_never_read_by_array_calls(cluster):
    """JAX keeps the first shard list it builds for an array; a first read from two threads at
    once can leave a partial or doubled one. Array calls read an input's shards by index
    (`addressable_data`, checked to name each addressable device once), never from that list:
    with a broken one kept, the call still gets the right values."""
    mesh = cluster.mesh(("data",))
    values = np.arange(64.0).reshape(8, 8)
    for spec in (P(), P("data")):
        x = jax.device_put(values, NamedSharding(mesh, spec))
        shards = list(x.addressable_shards)
        for broken in (shards[:4], shards[:4] * 2, shards * 2):  # the lists JAX was seen to keep
            x.__dict__["addressable_shards"] = broken
            np.testing.assert_array_equal(np.asarray(colocar.colocated(plus)(x, 1)), values + 1)


def test_a_broken_shard_list_kept_by_jax_is_an_error_for_a_checkpoint_save(cluster, tmp_path):
    """A checkpoint save plans from the shard list (each shard's index): a broken one is
    refused before anything is written, never saved with a missing or doubled piece."""
    x = jax.device_put(np.arange(64.0).reshape(8, 8), NamedSharding(cluster.mesh(("data",)), P("data")))
    shards = list(x.addressable_shards)
    x.__dict__["addressable_shards"] = shards[:4] * 2
    with CheckpointManager(str(tmp_path / "ckpt"), cluster) as manager:
        with pytest.raises(colocar.ArrayLayoutError, match="JAX lists 8 addressable shards"):
            manager.save(0, {"x": x})
        assert manager.all_steps() == []


def test_staged_calls_keep_the_callers_program_order(cluster):
    """Calls staged on other threads still start in the caller's lanes, in order."""

    @colocar.colocated_class
    class Log:
        def __init__(self):
            self.seen = []

        def add(self, x, i):
            self.seen.append(i)
            return x

        def items(self, x):
            return x * 0 + len(self.seen), self.seen

    x = jax.device_put(np.arange(16.0), NamedSharding(cluster.mesh(("data",)), P("data")))
    log = Log()
    futures = [log.add.submit(x, i) for i in range(20)]
    _, seen = log.items(x)
    assert seen == list(range(20))
    for f in futures:
        np.testing.assert_array_equal(np.asarray(f.result()), np.arange(16.0))


def ran_here(x, path):
    open(path, "a").close()
    return x


class ArenaHog:
    """Holds `nbytes` of its sidecar's arena while it lives."""

    def __init__(self, nbytes):
        self.block = colocar.shm.empty(nbytes, np.uint8)


def test_a_staging_failure_on_one_host_starts_no_call_and_frees_the_others(make_cluster, tmp_path):
    c = make_cluster(hosts=2, arena_size=8 * MiB, alloc_timeout=0)
    hog = colocar.colocated_class(ArenaHog).on(c.hosts[1])(7 * MiB)
    x = jax.device_put(
        np.ones((2, MiB // 2), np.float32), NamedSharding(c.mesh(("hosts", "dev")), P("hosts"))
    )
    marker = tmp_path / "ran"
    with pytest.raises(ArenaFullError):  # 2 MiB per host: staged on host 0, no room on host 1
        colocar.colocated(ran_here)(x, str(marker))
    assert not marker.exists()  # no host ran it
    gc.collect()
    used = lambda h: h.stats()["pools"]["default"]["used"]  # noqa: E731
    wait_for(lambda: used(c.hosts[0]) == 0, "host 0's staged block to go back", timeout=10)
    del hog
