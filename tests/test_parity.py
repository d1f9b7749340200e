"""The same small programs through `jax.experimental.colocated_python` and through colocar.

On the CPU backend JAX runs colocated functions inline (the reference); colocar runs them in
sidecar processes on each host's block. Elementwise programs must agree exactly. The remaining
differences are listed in the README ("Differences from jax.experimental.colocated_python").
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.experimental import colocated_python as reference
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import colocar


def scale_and_shift(x):
    return x * 2 + 1


def pair(x, y):
    return x + y, x * y


PROGRAMS = {
    "scale_and_shift": (scale_and_shift, 1),
    "two_in_two_out": (pair, 2),
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
@pytest.mark.parametrize("spec", [P("data"), P(None, "data"), P()], ids=["rows", "cols", "replicated"])
def test_functions_agree(cluster, name, spec):
    fn, arity = PROGRAMS[name]
    mesh = cluster.mesh(("data",))
    sharding = NamedSharding(mesh, spec)
    inputs = [jax.device_put(np.arange(64.0).reshape(8, 8) + k, sharding) for k in range(arity)]
    expected = reference.colocated_python(fn)(*inputs)
    got = colocar.colocated(fn)(*inputs)
    for e, g in zip(jax.tree_util.tree_leaves(expected), jax.tree_util.tree_leaves(got), strict=True):
        assert g.sharding == e.sharding
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))


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
    assert got.sharding == expected.sharding
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_classes_agree(cluster):
    class Counter:
        def __init__(self, start):
            self.n = start

        def add(self, x):
            self.n += 1
            return x + self.n

    mesh = cluster.mesh(("data",))
    x = jax.device_put(np.arange(16.0).reshape(8, 2), NamedSharding(mesh, P("data")))
    ref = reference.colocated_python_class(Counter)(10)
    ours = colocar.colocated_class(Counter)(10)
    for _ in range(2):  # state persists between calls on both
        np.testing.assert_array_equal(np.asarray(ours.add(x)), np.asarray(ref.add(x)))
