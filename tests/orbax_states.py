"""The state the Orbax interop tests save and restore, shared by the tests and the Orbax peer
program (tests/programs/orbax_peer.py, which never imports colocar): nested dicts and lists;
float32, bfloat16, int32 and uint8 arrays and scalars; sharded and replicated over 8 devices."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def save_mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))


def restore_mesh() -> Mesh:
    """Another mesh over the same 8 devices, in another order: restores reshard."""
    return Mesh(np.array(jax.devices())[::-1].reshape(2, 4), ("x", "y"))


def values(seed: int) -> dict:
    """The state's contents as numpy arrays and plain numbers."""
    rng = np.random.default_rng(seed)
    return {
        "params": {
            "dense": {
                "kernel": rng.standard_normal((64, 32), np.float32),
                "bias": rng.standard_normal(32).astype(ml_dtypes.bfloat16),
            },
            "embed": rng.integers(-(2**31), 2**31 - 1, size=(16, 8), dtype=np.int32),
        },
        "opt": [np.int32(seed + 1), {"mu": rng.standard_normal((64, 32), np.float32)}],
        "pixels": rng.integers(0, 256, size=(24,), dtype=np.uint8),
        "step": seed,
        "lr": 0.25,
    }


SAVE_SPECS = {
    "params.dense.kernel": P("data", "model"),
    "params.dense.bias": P(),  # replicated
    "params.embed": P("data"),
    "opt.0": P(),
    "opt.1.mu": P(None, "model"),
}
RESTORE_SPECS = {
    "params.dense.kernel": P("y", "x"),
    "params.dense.bias": P("y"),
    "params.embed": P(None, "y"),
    "opt.0": P(),
    "opt.1.mu": P("x"),
}


def _name(path: tuple) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def state(seed: int) -> dict:
    """`values(seed)` as Orbax and colocar save it: JAX arrays on `save_mesh`, a numpy array,
    plain numbers."""
    mesh = save_mesh()

    def place(path: tuple, x):
        spec = SAVE_SPECS.get(_name(path))
        return jax.device_put(x, NamedSharding(mesh, spec)) if spec is not None else x

    return jax.tree_util.tree_map_with_path(place, values(seed))


def target(seed: int = 0) -> dict:
    """A restore target on `restore_mesh`, with other partitions than the save's."""
    mesh = restore_mesh()

    def spec(path: tuple, x):
        partition = RESTORE_SPECS.get(_name(path))
        if partition is None:
            return x
        return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=NamedSharding(mesh, partition))

    return jax.tree_util.tree_map_with_path(spec, values(seed))


def mismatches(restored: dict, seed: int) -> list[str]:
    """The leaves of `restored` that differ from `values(seed)` in type, dtype, shape or bytes
    (a JAX array: each shard this process holds), or that do not lie on the target's sharding."""
    expected = jax.tree_util.tree_flatten_with_path(values(seed))[0]
    got = dict(jax.tree_util.tree_flatten_with_path(restored)[0])
    wanted = dict(jax.tree_util.tree_flatten_with_path(target())[0])
    bad = []
    for path, value in expected:
        name, leaf, value = (
            _name(path),
            got.get(path),
            np.asarray(value) if not isinstance(value, int | float) else value,
        )
        if isinstance(value, int | float):
            if np.ndim(leaf) != 0 or isinstance(leaf, jax.Array) or leaf != value:
                bad.append(f"{name}: {leaf!r} != {value!r}")
            continue
        if leaf is None or leaf.dtype != value.dtype or tuple(leaf.shape) != value.shape:
            found = "nothing" if leaf is None else f"{leaf.dtype}{list(leaf.shape)}"
            bad.append(f"{name}: {found} != {value.dtype}{list(value.shape)}")
            continue
        pieces = (
            [(np.asarray(s.data), s.index) for s in leaf.addressable_shards]
            if isinstance(leaf, jax.Array)
            else [(leaf, ())]
        )
        if any(piece.tobytes() != value[index].tobytes() for piece, index in pieces):
            bad.append(f"{name}: the bytes differ")
        sharding = getattr(wanted.get(path), "sharding", None)
        if sharding is not None and not leaf.sharding.is_equivalent_to(sharding, leaf.ndim):
            bad.append(f"{name}: restored on {leaf.sharding}, the target asked {sharding}")
    return bad
