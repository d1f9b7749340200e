"""The same small programs through `jax.experimental.colocated_python` and through colocar.

On the CPU backend JAX runs colocated functions inline (the reference); colocar runs them in
sidecar processes on each host's block. Elementwise programs must agree exactly. The remaining
differences are listed in the README ("Differences from jax.experimental.colocated_python").

Values are read with `jnp` (`jnp.array_equal`, `jnp.sum`), never with `np.asarray`: JAX caches
an array's numpy read, which would hide a result whose memory changed after it was returned.
String arrays are the exception (jnp cannot read them; they travel pickled, never aliased).
Programs that colocar still gets wrong are marked xfail(strict=True) with the issue section
that fixes them, so that they fail as soon as the fix lands and the mark must go.
"""

from __future__ import annotations

import gc
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import wait_for
from jax.experimental import colocated_python as reference
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import colocar
from colocar.shm import ArenaFullError

MiB = 1 << 20

SMALL_ARENA = 4 * MiB


def scale_and_shift(x):
    return x * 2 + 1


def pair(x, y):
    return x + y, x * y


def double(x):
    return x + x  # every dtype: bool is a logical or, int8 wraps, on both sides


PROGRAMS = {
    "scale_and_shift": (scale_and_shift, 1),
    "two_in_two_out": (pair, 2),
}


def assert_same(got: Any, expected: Any, sharding: bool = True) -> None:
    """Same tree, and leaves of the same type, shape, dtype, sharding and values (read by jnp)."""
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    expected_leaves, expected_tree = jax.tree_util.tree_flatten(expected)
    assert got_tree == expected_tree
    for g, e in zip(got_leaves, expected_leaves, strict=True):
        assert isinstance(g, jax.Array), f"{type(g).__name__} where JAX returns a jax.Array"
        assert (g.shape, g.dtype) == (e.shape, e.dtype)
        if sharding:
            assert g.sharding.is_equivalent_to(e.sharding, g.ndim), (g.sharding, e.sharding)
        if g.dtype == np.dtypes.StringDType():
            assert np.array_equal(np.asarray(g), np.asarray(e))
        else:
            assert bool(jnp.array_equal(g, e))


def on_shards(body):
    """The JAX side of a numpy program: JAX hands the function jax.Arrays, colocar numpy blocks;
    this runs `body` on each shard's numpy data, as JAX's own string test does."""

    def run(x):
        outs = [jax.device_put(body(np.asarray(s.data)), s.device) for s in x.addressable_shards]
        return jax.make_array_from_single_device_arrays(x.shape, x.sharding, outs)

    return run


def arena_used(host: Any) -> int:
    return host.stats()["pools"]["default"]["used"]


@pytest.fixture(scope="module")
def _small_cluster():
    """One sidecar with a small arena: exact arena accounting, and a result that cannot fit."""
    with colocar.local_cluster(
        hosts=1, devices=jax.devices()[:2], arena_size=SMALL_ARENA, lease_seconds=5, heartbeat_seconds=0.5
    ) as c:
        yield c


@pytest.fixture
def small(_small_cluster):
    return _small_cluster.make_current()


# --- elementwise programs -------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PROGRAMS))
@pytest.mark.parametrize("spec", [P("data"), P(None, "data"), P()], ids=["rows", "cols", "replicated"])
def test_functions_agree(cluster, name, spec):
    fn, arity = PROGRAMS[name]
    mesh = cluster.mesh(("data",))
    sharding = NamedSharding(mesh, spec)
    inputs = [jax.device_put(np.arange(64.0).reshape(8, 8) + k, sharding) for k in range(arity)]
    assert_same(colocar.colocated(fn)(*inputs), reference.colocated_python(fn)(*inputs))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.int8, np.bool_, np.complex64], ids=str)
def test_dtypes_agree(cluster, dtype):
    x = jax.device_put(
        (np.arange(64).reshape(8, 8) * 37).astype(dtype), NamedSharding(cluster.mesh(("data",)), P("data"))
    )
    assert_same(colocar.colocated(double)(x), reference.colocated_python(double)(x))


@pytest.mark.parametrize(
    ("shape", "spec"),
    [((8, 5), P("data")), ((3, 7), P()), ((1, 8), P(None, "data")), ((8, 0), P("data")), ((0, 8), P("data"))],
    ids=["8x5-rows", "3x7-replicated", "1x8-cols", "8x0-rows", "0x8-rows"],
)
def test_uneven_and_empty_shapes_agree(cluster, shape, spec):
    x = jax.device_put(
        np.arange(np.prod(shape), dtype=np.float32).reshape(shape),
        NamedSharding(cluster.mesh(("data",)), spec),
    )
    expected = reference.colocated_python(scale_and_shift)(x)
    got = colocar.colocated(scale_and_shift)(x)
    # JAX's inline jit turns an empty output's sharding into P(); colocar keeps the input's.
    assert_same(got, expected, sharding=0 not in shape)
    assert got.sharding == x.sharding


def tree_program(a, *, params):
    return {"sum": a + params["w"], "scaled": [a * params["scale"], params["w"] - 1]}


def test_pytrees_with_keyword_arguments_agree(cluster):
    mesh = cluster.mesh(("data",))
    a = jax.device_put(np.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("data")))
    w = jax.device_put(np.arange(32.0).reshape(8, 4) * 3, NamedSharding(mesh, P("data")))
    scale = jax.device_put(np.float32(3.0), NamedSharding(mesh, P()))
    params = {"w": w, "scale": scale}
    assert_same(
        colocar.colocated(tree_program)(a, params=params),
        reference.colocated_python(tree_program)(a, params=params),
    )


def add_bias(x, bias):
    return x + bias


def test_replicated_inputs_beside_sharded_ones_agree(cluster):
    mesh = cluster.mesh(("data",))
    x = jax.device_put(np.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("data")))
    bias = jax.device_put(np.arange(4.0) * 10, NamedSharding(mesh, P()))  # every host gets all of it
    assert_same(colocar.colocated(add_bias)(x, bias), reference.colocated_python(add_bias)(x, bias))
    assert_same(colocar.colocated(add_bias)(bias, bias), reference.colocated_python(add_bias)(bias, bias))


def test_no_input_function_with_devices_and_out_specs(cluster):
    mesh = cluster.mesh(("data",))
    spec = jax.ShapeDtypeStruct((8, 3), np.float32, sharding=NamedSharding(mesh, P("data")))

    def make_reference():
        return jax.device_put(np.ones((8, 3), np.float32), spec.sharding)

    def make_block():
        return np.ones((4, 3), np.float32)  # each of the 2 hosts returns its block

    expected = reference.colocated_python(make_reference).specialize(
        devices=cluster.devices, out_specs_fn=lambda: spec
    )()
    got = colocar.colocated(make_block).specialize(devices=cluster.devices, out_specs_fn=lambda: spec)()
    assert_same(got, expected)


def test_calls_from_several_threads_agree(cluster):
    mesh = cluster.mesh(("data",))
    block = np.arange(8 * 4096, dtype=np.float32).reshape(8, -1)  # 64 KiB per host: results in the arena
    inputs = [jax.device_put(block * k, NamedSharding(mesh, P("data"))) for k in range(8)]
    expected = [reference.colocated_python(scale_and_shift)(x) for x in inputs]
    ours = colocar.colocated(scale_and_shift)
    start = threading.Barrier(4, timeout=30)  # all four threads call at once

    def worker(k: int) -> list[Any]:
        start.wait()
        return [ours(inputs[i]) for i in range(k, len(inputs), 4)]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(worker, range(4)))
    for k, got in enumerate(results):
        for i, g in zip(range(k, len(inputs), 4), got, strict=True):
            assert_same(g, expected[i])


def test_results_used_after_the_cluster_closed(make_cluster):
    c = make_cluster(hosts=1, devices=jax.devices()[:2])
    x = jax.device_put(
        np.arange(64 * 1024, dtype=np.float32).reshape(2, -1), NamedSharding(c.mesh(("data",)), P("data"))
    )
    got = colocar.colocated(scale_and_shift)(x)  # 256 KiB: a view of the arena on the controller
    tree = colocar.colocated(lambda v: {"same": v, "next": [v + 1]})(x)
    c.close()
    expected = reference.colocated_python(scale_and_shift)(x)
    assert_same(got, expected)
    assert bool(jnp.array_equal(tree["same"], x)) and bool(jnp.array_equal(tree["next"][0], x + 1))
    assert float(jnp.sum(got)) == float(jnp.sum(expected))


# --- classes --------------------------------------------------------------------------------
class Counter:
    def __init__(self, start):
        self.n = start

    def add(self, x):
        self.n += 1
        return x + self.n


def test_class_state_across_calls_and_release(cluster):
    mesh = cluster.mesh(("data",))
    x = jax.device_put(np.arange(16.0).reshape(8, 2), NamedSharding(mesh, P("data")))
    before = [h.stats()["objects"] for h in cluster.hosts]
    ref = reference.colocated_python_class(Counter)(10)
    ours = colocar.colocated_class(Counter)(10)
    for _ in range(3):  # state persists between calls on both
        assert_same(ours.add(x), ref.add(x))
    assert [h.stats()["objects"] for h in cluster.hosts] == [n + 1 for n in before]
    del ours
    gc.collect()
    wait_for(lambda: [h.stats()["objects"] for h in cluster.hosts] == before, "the dropped object's release")


class Accumulator:
    """Issue 13, section 1: keeps its first input and adds to it in place (numpy) afterwards."""

    def __init__(self):
        self.total = None

    def add(self, x):
        if self.total is None:
            self.total = x  # keeps the input
        else:
            self.total += x  # numpy: in place
        return self.total


def test_accumulator_results_never_change(cluster):
    x = jax.device_put(np.arange(1024, dtype=np.float32), jax.local_devices()[0])
    ref = reference.colocated_python_class(Accumulator)()
    ours = colocar.colocated_class(Accumulator)()
    expected1, got1 = ref.add(x), ours.add(x)
    assert float(jnp.sum(got1)) == float(jnp.sum(expected1)) == 523776.0
    expected2, got2 = ref.add(x), ours.add(x)
    assert_same(got2, expected2)
    assert float(jnp.sum(expected1)) == 523776.0
    assert float(jnp.sum(got1)) == 523776.0  # JAX arrays are immutable: out1 must not change


_CACHE: dict[str, Any] = {}


def running_total(x):
    """Issue 13, section 1: a module-level cache in a plain function."""
    if "total" in _CACHE:
        _CACHE["total"] += x
    else:
        _CACHE["total"] = x
    return _CACHE["total"]


def clear_cache():
    _CACHE.clear()


def test_module_level_cache_results_never_change(cluster):
    x = jax.device_put(np.arange(1024, dtype=np.float32), jax.local_devices()[0])
    clear_cache()
    colocar.colocated(clear_cache).on(cluster.hosts)()
    ref, ours = reference.colocated_python(running_total), colocar.colocated(running_total)
    expected1, got1 = ref(x), ours(x)
    expected2, got2 = ref(x), ours(x)
    assert_same(got2, expected2)
    assert_same(got1, expected1)  # the first result kept its value
    assert float(jnp.sum(got1)) == 523776.0


# --- strings and other object-like dtypes (issue 13, section 3) ----------------------------------
def upper(x):
    return np.strings.upper(x)


@pytest.mark.parametrize(
    ("clusters", "processes"),
    [("cluster", False), ("cluster", True), ("grpc_cluster", False)],
    ids=["thread", "process", "without-shm"],
)
def test_string_arrays_agree(request, clusters, processes):
    """JAX's own colocated string test: upper-case each shard of a StringDType array."""
    cluster = request.getfixturevalue(clusters)
    # 64 KiB of string pointers per host: each block travels pickled through an arena block
    strings = np.array([f"row {i}" for i in range(8192)], dtype=np.dtypes.StringDType())
    x = jax.device_put(strings, NamedSharding(cluster.mesh(("data",)), P("data")))
    expected = reference.colocated_python(on_shards(upper))(x)
    got = colocar.colocated(upper, processes=processes)(x)
    assert_same(got, expected)
    assert got.sharding == x.sharding


def test_string_and_object_arrays_in_plain_value_calls(cluster):
    host = cluster.hosts[0]
    strings = np.array(["a", "bc"] * 20000, dtype=np.dtypes.StringDType())  # large, still pickled
    objects = np.array([{"k": 1}, None, "x"] * 10000, dtype=object)
    got_strings, got_objects = colocar.colocated(lambda s, o: (upper(s), o[:3])).on(host)(strings, objects)
    assert np.array_equal(got_strings, upper(strings)) and got_strings.dtype == strings.dtype
    assert list(got_objects) == [{"k": 1}, None, "x"]
    made = colocar.colocated(lambda: colocar.shm.empty(3, np.dtypes.StringDType()).shape).on(host)()
    assert made == (3,)  # colocar.shm.empty gives object-like dtypes ordinary memory


def test_failed_and_string_calls_free_their_blocks(small):
    host = small.hosts[0]
    gc.collect()
    before = arena_used(host)
    strings = jax.device_put(np.array(["a", "bc"], dtype=np.dtypes.StringDType()), small.devices[0])
    for _ in range(3):  # each used to fail and leave its staging block allocated
        assert_same(colocar.colocated(upper)(strings), reference.colocated_python(on_shards(upper))(strings))
    many = np.array(["a", "bc"] * 20000, dtype=np.dtypes.StringDType())  # pickled through blocks
    assert np.array_equal(colocar.colocated(upper).on(host)(many), upper(many))
    numbers = jax.device_put(np.arange(1024.0), small.devices[0])
    with pytest.raises(colocar.SerializationError):
        colocar.colocated(add_bias)(numbers, bias=threading.Lock())  # fails after staging `numbers`
    with pytest.raises(ZeroDivisionError):
        colocar.colocated(divide_by_zero)(numbers)
    gc.collect()
    wait_for(lambda: arena_used(host) == before, f"arena use back to {before} bytes", timeout=10)


def divide_by_zero(x):
    return x.size // 0


class ArenaHog:
    """Holds `nbytes` of its sidecar's arena while it lives (fills one host's arena)."""

    def __init__(self, nbytes):
        self.block = colocar.shm.empty(nbytes, np.uint8)


def test_a_call_failing_on_one_host_frees_the_others_results(make_cluster):
    c = make_cluster(hosts=2, arena_size=8 * MiB, alloc_timeout=0)
    hog = colocar.colocated_class(ArenaHog).on(c.hosts[1])(7 * MiB)
    x = jax.device_put(
        np.ones((2, MiB // 2), np.float32), NamedSharding(c.mesh(("hosts", "dev")), P("hosts"))
    )
    with pytest.raises(ArenaFullError):  # 2 MiB per host: staged on host 0, no room on host 1
        colocar.colocated(scale_and_shift)(x)
    gc.collect()
    wait_for(lambda: arena_used(c.hosts[0]) == 0, "host 0's result to go back to its arena", timeout=10)
    del hog


@pytest.mark.xfail(
    strict=True,
    reason="a submit() future dropped unread keeps its reply's result blocks leased until the "
    "session ends (calls.py CallFuture, which issue 13 section 2 reworks for cancel/timeouts)",
)
def test_results_dropped_unread_free_their_blocks(small):
    host = small.hosts[0]
    gc.collect()
    before = arena_used(host)
    x = jax.device_put(np.ones(64 * 1024, np.float32), small.devices[0])  # 256 KiB result
    reference.colocated_python(scale_and_shift)(x)  # JAX: a dropped result is simply freed
    future = colocar.colocated(scale_and_shift).submit(x)
    del future
    gc.collect()
    wait_for(lambda: arena_used(host) == before, f"arena use back to {before} bytes", timeout=3)


# --- results too large for the arena (issue 13, section 4) ------------------------------------
def larger_than_small_arena(x):
    return x + np.zeros(SMALL_ARENA // 4 + 1024, np.float32)


def test_result_larger_than_the_arena_raises_arena_full(small):
    x = jax.device_put(np.ones(1, np.float32), small.devices[0])
    expected = reference.colocated_python(larger_than_small_arena)(x)
    assert float(jnp.sum(expected)) == expected.size  # JAX has no arena: it just works
    with pytest.raises(ArenaFullError, match="default"):
        colocar.colocated(larger_than_small_arena)(x)


# --- 0-d arrays (issue 13, section 5) ---------------------------------------------------------
def plus_one(x):
    return x + 1


def test_zero_d_inputs_and_results_agree(cluster):
    x = jax.device_put(np.array(1, np.int32), jax.local_devices()[0])
    assert_same(colocar.colocated(plus_one)(x), reference.colocated_python(plus_one)(x))


def test_zero_d_replicated_on_two_hosts_agree(cluster):
    x = jax.device_put(np.array(1.5, np.float32), NamedSharding(cluster.mesh(("data",)), P()))
    assert_same(colocar.colocated(plus_one)(x), reference.colocated_python(plus_one)(x))


# --- typed PRNG keys (issue 13, section 6) ------------------------------------------------------
def draw(key):
    return jax.random.uniform(key, (3,))


def draw_from_key_data(key_data):
    """colocar hands the function the keys' data (numpy has no key dtype): wrap it again."""
    return np.asarray(draw(jax.random.wrap_key_data(key_data)))


def draw_each_from_key_data(key_data):
    return np.asarray(jax.vmap(draw)(jax.random.wrap_key_data(key_data)))


def test_prng_keys_agree(cluster):
    key = jax.device_put(jax.random.key(0), jax.local_devices()[0])
    assert_same(colocar.colocated(draw_from_key_data)(key), reference.colocated_python(draw)(key))
    passed = colocar.colocated(lambda k: k)(key)
    assert_same(passed, jax.random.key_data(key))


def test_sharded_prng_keys_agree(cluster):
    keys = jax.device_put(
        jax.random.split(jax.random.key(7), 8), NamedSharding(cluster.mesh(("data",)), P("data"))
    )
    expected = reference.colocated_python(jax.vmap(draw))(keys)
    assert_same(colocar.colocated(draw_each_from_key_data)(keys), expected)


def test_prng_keys_in_plain_value_calls(cluster):
    key = jax.random.key(3)
    got = colocar.colocated(lambda k: (type(k).__name__, k)).on(cluster.hosts[0])(key)
    assert got[0] == "ndarray" and np.array_equal(got[1], jax.random.key_data(key))
