"""The same small programs through `jax.experimental.colocated_python` and through colocar.

On the CPU backend JAX runs colocated functions inline (the reference); colocar runs them in
sidecar processes on each host's block. Elementwise programs must agree exactly. The remaining
differences are listed in docs/coming-from.md ("Coming from jax.experimental.colocated_python").

Values are read with `jnp` (`jnp.array_equal`, `jnp.sum`), never with `np.asarray`: JAX caches
an array's numpy read, which would hide a result whose memory changed after it was returned.
Strings, 0-d arrays, PRNG keys and results larger than the arena are in test_parity_values.py.
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
from parity_helpers import add_bias, assert_same, scale_and_shift

import colocar


def pair(x, y):
    return x + y, x * y


def double(x):
    return x + x  # every dtype: bool is a logical or, int8 wraps, on both sides


PROGRAMS = {
    "scale_and_shift": (scale_and_shift, 1),
    "two_in_two_out": (pair, 2),
}


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
