"""Round trips through real sidecars: functions, arrays, classes, generators, ordering, copies."""

from __future__ import annotations

import threading

import jax
import ml_dtypes
import numpy as np
import pytest
from helpers import printed_until, recorded_stdout
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import colocar
from colocar.shm import block_of

MiB = 1 << 20


@colocar.colocated
def identity(x):
    return x


@colocar.colocated
def scale(x):
    return x * 2


def test_plain_values_on_hosts(cluster):
    @colocar.colocated
    def add(a, b=1):
        return a + b

    assert add.on(cluster.hosts)(1, b=2) == [3, 3]
    assert add.on(cluster.hosts[1])(41) == 42


def test_sidecars_are_separate_processes(cluster):
    import os

    @colocar.colocated
    def pid():
        import os

        return os.getpid()

    pids = pid.on(cluster.hosts)()
    assert len(set(pids)) == 2 and os.getpid() not in pids


@pytest.mark.parametrize(
    "array",
    [
        np.arange(10, dtype=np.int32),
        np.float32(3.5) * np.ones(()),
        np.zeros((0, 3), np.float64),
        np.arange(48, dtype=np.float32).reshape(6, 8)[:, ::2],  # non-contiguous
        np.arange(300_000, dtype=np.float32).astype(ml_dtypes.bfloat16),  # large, bfloat16
        np.random.default_rng(0).random((512, 256)),  # large float64
        np.array([True, False]),
    ],
    ids=["int32", "0-d", "empty", "non-contiguous", "bfloat16-large", "float64-large", "bool"],
)
@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_array_round_trip(request, array, transport):
    c = request.getfixturevalue("cluster" if transport == "shm" else "grpc_cluster")
    out = identity.on(c.hosts[0])(array)
    assert out.dtype == array.dtype and out.shape == array.shape
    np.testing.assert_array_equal(out, array)


def test_global_array_in_and_out(cluster):
    mesh = cluster.mesh(("data",))
    x = jax.device_put(np.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("data")))
    y = scale(x)
    assert y.sharding == x.sharding
    np.testing.assert_array_equal(np.asarray(y), np.arange(64.0).reshape(8, 8) * 2)


def test_each_host_gets_its_block(cluster):
    mesh = cluster.mesh(("data",))
    x = jax.device_put(np.arange(16.0).reshape(8, 2), NamedSharding(mesh, P("data")))

    @colocar.colocated
    def first_row(x):
        return x[:1] + 0  # one row per host: does not fit x's sharding

    with pytest.raises(colocar.ArrayLayoutError, match="out_specs_fn"):
        first_row(x)
    spec = jax.ShapeDtypeStruct((2, 2), x.dtype, sharding=NamedSharding(cluster.mesh(("h", "d")), P("h")))
    rows = first_row.specialize(out_specs_fn=lambda x: spec)(x)
    np.testing.assert_array_equal(np.asarray(rows), [[0.0, 1.0], [8.0, 9.0]])


def test_replicated_input_is_sent_once_per_host(cluster):
    mesh = cluster.mesh(("data",))
    x = jax.device_put(np.arange(12.0), NamedSharding(mesh, P()))

    @colocar.colocated
    def total(x):
        return x * 0 + x.sum()

    y = total(x)
    np.testing.assert_array_equal(np.asarray(y), np.full(12, 66.0))


def test_two_dimensional_mesh_and_out_specs_fn(cluster):
    mesh = cluster.mesh(("hosts", "local"))
    assert mesh.devices.shape == (2, 4)
    sharding = NamedSharding(mesh, P("hosts", "local"))
    x = jax.device_put(np.arange(32.0).reshape(4, 8), sharding)

    @colocar.colocated
    def row_sums(x):
        return x.sum(axis=1)

    out_sharding = NamedSharding(mesh, P("hosts"))
    f = row_sums.specialize(out_specs_fn=lambda x: jax.ShapeDtypeStruct((4,), x.dtype, sharding=out_sharding))
    y = f(x)
    assert y.sharding == out_sharding
    np.testing.assert_array_equal(np.asarray(y), np.arange(32.0).reshape(4, 8).sum(axis=1))


def test_outputs_split_by_columns_come_back_whole(cluster):
    """Each device's piece of a host's result block is a strided view (columns): it reaches
    its device as the right values all the same."""
    mesh = cluster.mesh(("hosts", "local"))
    values = np.arange(8.0 * 16).reshape(8, 16)
    x = jax.device_put(values, NamedSharding(mesh, P(None, ("hosts", "local"))))
    y = colocar.colocated(lambda x: x * 2)(x)
    assert y.sharding == x.sharding
    np.testing.assert_array_equal(np.asarray(y), values * 2)
    for shard in y.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), values[shard.index] * 2)


def test_a_float64_result_comes_back_as_jax_makes_it(cluster):
    """A dtype JAX converts (float64 without x64) takes device_put's path, not the batched put:
    the values arrive, in JAX's dtype."""
    values = np.arange(16.0)
    x = jax.device_put(values, NamedSharding(cluster.mesh(("data",)), P("data")))
    y = colocar.colocated(lambda x: np.asarray(x, np.float64) * 2)(x)
    assert y.dtype == jax.dtypes.canonicalize_dtype(np.float64)
    np.testing.assert_array_equal(np.asarray(y), values * 2)


def test_function_without_array_inputs_needs_devices(cluster):
    @colocar.colocated
    def make():
        return np.ones((4, 3), np.float32)

    with pytest.raises(ValueError, match="specialize\\(devices"):
        make()
    mesh = cluster.mesh(("data",))
    spec = jax.ShapeDtypeStruct((8, 3), np.float32, sharding=NamedSharding(mesh, P("data")))
    y = make.specialize(devices=cluster.devices, out_specs_fn=lambda: spec)()
    assert y.shape == (8, 3)
    np.testing.assert_array_equal(np.asarray(y), np.ones((8, 3)))


def test_non_rectangular_host_blocks_fail_clearly(cluster):
    devices = cluster.devices
    # interleave the hosts' devices so a host's shards are not one block
    order = [devices[i] for i in (0, 4, 1, 5, 2, 6, 3, 7)]
    mesh = jax.sharding.Mesh(np.array(order, dtype=object), ("data",))
    x = jax.device_put(np.arange(8.0), NamedSharding(mesh, P("data")))
    with pytest.raises(colocar.ArrayLayoutError, match="hyper-rectangle"):
        scale(x)

    @colocar.colocated
    def doubled(shards):
        return [s * 2 for s in shards]

    # With per_device_shards the function gets each device's shard and results come per host.
    per_host = doubled.specialize(per_device_shards=True)(x)
    assert [[float(s[0]) for s in shards] for shards in per_host] == [[0, 4, 8, 12], [2, 6, 10, 14]]


def test_colocated_class(cluster):
    @colocar.colocated_class
    class Counter:
        def __init__(self, start):
            self.n = start

        def add(self, k):
            self.n += k
            return self.n

    c = Counter.on(cluster.hosts[0])(10)
    assert c.add(5) == 15
    assert c.add.submit(1).result() == 16
    other = Counter.on(cluster.hosts[1])(0)
    assert other.add(1) == 1


def test_generator_streams_items(cluster):
    @colocar.colocated
    def count(n):
        for i in range(n):
            yield np.full(100_000, i, np.float32)

    items = list(count.on(cluster.hosts[0])(5))
    assert [int(a[0]) for a in items] == list(range(5))


def test_a_stream_waits_for_room_its_consumer_frees(make_cluster):
    """Items of 3 MiB into an 8 MiB arena while the consumer still holds two: the third waits
    for one to be dropped (before, it failed at once with ArenaFullError)."""
    c = make_cluster(hosts=1, arena_size=8 * MiB, processes=0)

    @colocar.colocated
    def big(n):
        for i in range(n):
            yield np.full(3 * MiB, i, np.uint8)

    items = big.on(c.hosts[0])(4)
    held = [next(items), next(items)]
    threading.Timer(0.5, held.pop, (0,)).start()  # the consumer drops the first a little later
    third = next(items)
    assert int(third[0]) == 2 and int(held[0][0]) == 1
    del third, held
    assert [int(a[0]) for a in items] == [3]


def test_generator_early_close_stops_remote(cluster):
    @colocar.colocated
    def forever():
        i = 0
        while True:
            yield i
            i += 1

    it = forever.on(cluster.hosts[1])()
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    it.close()
    assert identity.on(cluster.hosts[1])(7) == 7


def test_calls_from_one_thread_run_in_order(cluster):
    @colocar.colocated_class
    class Log:
        def __init__(self):
            self.items = []

        def append(self, x):
            self.items.append(x)

        def get(self):
            return self.items

    log = Log.on(cluster.hosts[0])()
    futures = [log.append.submit(i) for i in range(50)]
    for f in futures:
        f.result()
    assert log.get() == list(range(50))


def test_concurrent_calls_from_eight_threads(cluster):
    results: dict[int, list] = {}

    @colocar.colocated
    def tag(thread, i, payload):
        return thread, i, float(payload.sum())

    def worker(t):
        payload = np.full(50_000, t, np.float32)
        results[t] = [tag.on(cluster.hosts[t % 2])(t, i, payload) for i in range(10)]

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(results) == list(range(8))
    for t, rows in results.items():
        assert rows == [(t, i, 50_000.0 * t) for i in range(10)]


def test_results_are_zero_copy_views_of_the_arena(cluster):
    @colocar.colocated
    def make(n):
        out = colocar.shm.empty((n,), np.float32)
        out[:] = 1.5
        return out

    out = make.on(cluster.hosts[0])(1 << 20)
    found = block_of(out)
    assert found is not None and found[0] is cluster.hosts[0].connection.blocks.arena
    assert out.sum() == 1.5 * (1 << 20)


def test_input_is_copied_once_into_the_arena(cluster):
    """The sidecar sees the input as a view of its arena (the only copy: controller -> arena)."""

    @colocar.colocated
    def where(x):
        from colocar.shm import block_of

        return block_of(x) is not None

    assert where.on(cluster.hosts[0])(np.ones(1 << 18, np.float32))


def test_shipped_jax_sees_only_cpu(cluster):
    @colocar.colocated
    def platforms():
        import jax

        return sorted({d.platform for d in jax.devices()})

    assert platforms.on(cluster.hosts[0])() == ["cpu"]


def test_logs_reach_the_controller_with_host_prefix(cluster):
    @colocar.colocated
    def talk():
        print("hello from the sidecar")
        return 1

    with recorded_stdout() as stdout:
        talk.on(cluster.hosts[1])()
        seen = printed_until(stdout, "[host1] hello from the sidecar")
    assert "[host1] hello from the sidecar\n" in seen


def test_generator_flow_control_bounds_items_in_flight(cluster):
    """The consumer's credits bound how far the remote generator runs ahead."""
    import time

    from helpers import wait_for

    @colocar.colocated(prefetch=2)
    def numbers():
        import sys

        for i in range(1000):
            sys.colocar_test_produced = i + 1  # type: ignore[attr-defined]
            yield i

    @colocar.colocated
    def produced():
        import sys

        return getattr(sys, "colocar_test_produced", 0)

    host = cluster.hosts[0]
    it = numbers.on(host)()
    assert next(it) == 0
    wait_for(lambda: produced.on(host)() >= 2, "the generator to run ahead")
    time.sleep(0.5)  # room to overrun, were credits not enforced
    assert produced.on(host)() <= 3  # one taken + two credits
    assert [next(it) for _ in range(5)] == [1, 2, 3, 4, 5]
    it.close()


def test_a_lazy_object_seen_through_a_cluster_over_some_hosts_keeps_each_hosts_instance(cluster):
    """A cluster over some hosts numbers them anew (the elastic manager's survivors): host 1,
    now index 0 there, must still get its own instance, not host 0's."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from colocar.elastic.policy.survivors import ClusterView

    @colocar.colocated_class
    class Remembers:
        def __init__(self):
            self.first = None

        def see(self, x):
            if self.first is None:
                self.first = float(x.min())
            return x * 0 + self.first

    obj = Remembers()
    c = cluster.make_current()
    x = jax.device_put(np.arange(16, dtype=np.float32), NamedSharding(c.mesh(("d",)), P("d")))
    whole = np.asarray(obj.see(x))  # each host's instance remembers its own first block
    view = ClusterView(c, [c.hosts[1]])
    try:
        mesh = jax.sharding.Mesh(np.array(c.hosts[1].devices), ("d",))
        y = jax.device_put(np.arange(8, dtype=np.float32) + 100, NamedSharding(mesh, P("d")))
        assert set(np.asarray(obj.see(y)).tolist()) == {whole[8]}  # host 1's instance; was host 0's
    finally:
        view.close()
        c.make_current()
