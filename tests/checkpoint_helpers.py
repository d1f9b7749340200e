"""What the checkpoint tests share: a sharded test state, bit-exact comparison, targets, where
a step's committed attempt lies."""

from __future__ import annotations

import json
import os

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from colocar.checkpoint.format import layout

MiB = 1 << 20


def make_state(seed: int = 0, rows: int = 64) -> dict:
    """Arrays sharded over the session cluster's 8 devices (2 hosts x 4), and plain values."""
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    rng = np.random.default_rng(seed)
    return {
        "params": {
            "w": jax.device_put(
                rng.standard_normal((rows, 32), np.float32), NamedSharding(mesh, P("data", "model"))
            ),
            "b": jax.device_put(rng.standard_normal(32).astype(ml_dtypes.bfloat16), NamedSharding(mesh, P())),
        },
        "step": seed,
        "data": {"epoch": 1, "positions": [3, 5], "source": "train"},
    }


def assert_same(a, b) -> None:
    """Bit-exact equality of two trees (arrays compared as bytes, keys by key data)."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, jax.Array | np.ndarray):
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                assert y.dtype == x.dtype
                x, y = jax.random.key_data(x), jax.random.key_data(y)
            x, y = np.asarray(x), np.asarray(y)
            assert x.dtype == y.dtype and x.shape == y.shape
            assert x.tobytes() == y.tobytes()
        else:
            assert x == y


def abstract(tree):
    return jax.tree_util.tree_map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x
        ),
        tree,
    )


def attempt_path(directory: str, step: int) -> str:
    """The directory of the save attempt that committed `step` (uncommitted: its only attempt)."""
    step_dir = os.path.join(directory, layout.step_dir(step))
    committed = os.path.join(step_dir, layout.COMMITTED)
    if os.path.exists(committed):
        with open(committed) as f:
            return os.path.join(step_dir, layout.ATTEMPT_PREFIX + json.load(f)["attempt"])
    (only,) = [n for n in os.listdir(step_dir) if n.startswith(layout.ATTEMPT_PREFIX)]
    return os.path.join(step_dir, only)


def drill_state(step: int, generation: int, rows: int) -> dict:
    """The crash drills' state of `step` as trainer `generation` saves it: every element says
    which step and trainer wrote it, so a mixed restore cannot pass for either."""
    mesh = Mesh(np.array(jax.devices()).reshape(8), ("d",))
    values = (
        np.arange(rows * 64, dtype=np.int32).reshape(rows, 64) + step * 10_000_000 + generation * 1_000_000
    )
    return {"w": jax.device_put(values, NamedSharding(mesh, P("d"))), "step": step, "generation": generation}
