"""The same programs through `jax.experimental.colocated_python` and through colocar, for the
values issue 13 is about: strings and other object-like dtypes, results larger than the arena,
0-d arrays and typed PRNG keys (see test_parity.py for the reference and the xfail rule).

String arrays are read with numpy (jnp cannot read them; they travel pickled, never aliased).
"""

from __future__ import annotations

import gc
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import wait_for
from jax.experimental import colocated_python as reference
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from parity_helpers import SMALL_ARENA, MiB, add_bias, arena_used, assert_same, on_shards, scale_and_shift

import colocar
from colocar.shm import ArenaFullError


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
