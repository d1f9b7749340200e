"""`specialize` follows JAX's rule, for functions and for methods of `colocated_class`.

As in `jax.experimental.colocated_python`: `in_specs`, `out_specs_fn` and `devices` are each
given once along a chain of `specialize` calls (a second raises), and the `in_specs` given are
checked against every call's arguments: a mismatch raises before anything runs.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import colocar


def scale(x, factor=2.0):
    return x * factor


class Scaler:
    def __init__(self, factor):
        self.factor = factor

    def apply(self, x):
        return x * self.factor


def _rows(cluster):
    mesh = cluster.mesh(("data",))
    x = jax.device_put(np.arange(16.0).reshape(8, 2), NamedSharding(mesh, P("data")))
    return x, jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def _specializables(cluster):
    """A colocated function and a method of a colocated class, both scaling by 2."""
    return [colocar.colocated(scale), colocar.colocated_class(Scaler)(2.0).apply]


@pytest.mark.parametrize("kind", [0, 1], ids=["function", "method"])
def test_each_specialization_is_given_once(cluster, kind):
    f = _specializables(cluster)[kind]
    x, spec = _rows(cluster)
    out = lambda *a, **k: spec  # noqa: E731
    in_specs = ((spec,), {})
    for given in ({"out_specs_fn": out}, {"devices": cluster.devices}, {"in_specs": in_specs}):
        once = f.specialize(**given)
        name = next(iter(given))
        with pytest.raises(ValueError, match=f"{name} already specified"):
            once.specialize(**given)
    # different ones may be given one after another, in any order
    both = f.specialize(out_specs_fn=out).specialize(in_specs=in_specs).specialize(devices=cluster.devices)
    np.testing.assert_array_equal(np.asarray(both(x)), np.arange(16.0).reshape(8, 2) * 2)


def test_colocar_options_may_be_given_again(cluster):
    f = colocar.colocated(scale).specialize(timeout=1.0).specialize(timeout=30.0)
    x, _ = _rows(cluster)
    np.testing.assert_array_equal(np.asarray(f(x)), np.arange(16.0).reshape(8, 2) * 2)


@pytest.mark.parametrize("kind", [0, 1], ids=["function", "method"])
def test_calls_matching_their_in_specs_run(cluster, kind):
    f = _specializables(cluster)[kind]
    x, spec = _rows(cluster)
    g = f.specialize(in_specs=((spec,), {}))
    np.testing.assert_array_equal(np.asarray(g(x)), np.arange(16.0).reshape(8, 2) * 2)
    np.testing.assert_array_equal(np.asarray(g.submit(x).result()), np.arange(16.0).reshape(8, 2) * 2)


@pytest.mark.parametrize("kind", [0, 1], ids=["function", "method"])
def test_calls_not_matching_their_in_specs_raise(cluster, kind):
    f = _specializables(cluster)[kind]
    x, spec = _rows(cluster)
    g = f.specialize(in_specs=((spec,), {}))
    other = jax.device_put(np.arange(8.0), NamedSharding(cluster.mesh(("data",)), P("data")))
    with pytest.raises(ValueError, match=r"argument \[0\]\[0\].*float32\[8, 2\].*float32\[8\]"):
        g(other)
    with pytest.raises(ValueError, match=r"float32\[8, 2\], the argument int32\[8, 2\]"):
        g(x.astype(np.int32))
    replicated = jax.device_put(np.arange(16.0).reshape(8, 2), NamedSharding(cluster.mesh(("data",)), P()))
    with pytest.raises(ValueError, match="sharding"):
        g(replicated)
    with pytest.raises(ValueError, match="structure"):
        g(x, x)
    with pytest.raises(ValueError, match="structure"):
        g(x=x)
    with pytest.raises(ValueError, match="not a jax.Array"):
        g(np.asarray(x))


def test_in_specs_give_plain_values_as_themselves(cluster):
    x, spec = _rows(cluster)
    g = colocar.colocated(scale).specialize(in_specs=((spec,), {"factor": 3.0}))
    np.testing.assert_array_equal(np.asarray(g(x, factor=3.0)), np.arange(16.0).reshape(8, 2) * 3)
    with pytest.raises(ValueError, match=r"argument \[1\]\['factor'\].*3\.0.*4\.0"):
        g(x, factor=4.0)


def test_in_specs_accept_an_equivalent_sharding(cluster):
    x, _ = _rows(cluster)
    equivalent = NamedSharding(cluster.mesh(("data",)), P("data", None))
    spec = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=equivalent)
    g = colocar.colocated(scale).specialize(in_specs=((spec,), {}))
    np.testing.assert_array_equal(np.asarray(g(x)), np.arange(16.0).reshape(8, 2) * 2)


def test_a_mismatch_raises_before_anything_runs(cluster, tmp_path):
    marker = tmp_path / "ran"

    def touch(x, path):
        open(path, "w").close()
        return x

    x, spec = _rows(cluster)
    g = colocar.colocated(touch).specialize(in_specs=((spec, str(marker)), {}))
    with pytest.raises(ValueError, match="does not match"):
        g(x[:4], str(marker))
    assert not marker.exists()
    np.testing.assert_array_equal(np.asarray(g(x, str(marker))), np.asarray(x))
    assert marker.exists()
