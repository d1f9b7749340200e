"""What the parity tests share: comparing colocar's results with JAX's, running a numpy body
on each shard for JAX, and reading a host's arena use. It imports no conftest: sidecars
import it when they unpickle the tests' functions.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

MiB = 1 << 20

SMALL_ARENA = 4 * MiB


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
    """Bytes in use in the host's default pool."""
    return host.stats()["pools"]["default"]["used"]


# --- programs that several parity test files ship ---------------------------------------------
def scale_and_shift(x):
    return x * 2 + 1


def add_bias(x, bias):
    return x + bias
