"""Pytrees to manifest entries and back (runs in the controller).

Leaves are named by `jax.tree_util.keystr` of their path (`['params']['w']`); the manifest
records each leaf by that name (an array leaf also with its directory: `keypaths`), plus a
JSON skeleton of dicts and lists so that a restore without a target can rebuild a tree of
plain containers. Arrays (`jax.Array`, numpy arrays,
typed PRNG keys, stored as their key data) are written by the sidecars; everything else
(numbers, strings, booleans, None, the data iterator's state) is stored in the manifest. An
object with `get_state()` (a data iterator) is saved as its state.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from colocar.controller_bridge.specs import spec_of
from colocar.errors import CheckpointError

from . import keypaths


def is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def is_prng_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None or isinstance(dtype, np.dtype):  # a key's dtype is JAX's own, never numpy's
        return False
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


_STRUCTURES: dict[Any, tuple[list[str], Any, dict[str, str]]] = {}  # see `flatten`
_STRUCTURES_KEPT = 64


def flatten(tree: Any) -> tuple[list[tuple[str, Any]], Any, dict[str, str]]:
    """[(key, leaf)] in tree order, the JSON skeleton of the tree, and the directory of each
    array leaf under `arrays/` by key (`keypaths.leaf_dirs`: its escaped key path).

    The names, skeleton and directories depend only on the tree's structure and on which
    leaves are arrays, so they are computed once per structure (a training loop snapshots the
    same structure every few steps); the skeleton and directories returned are shared: read
    them, never change them."""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_none)
    if any(_has_state(leaf) for leaf in leaves):  # iterators as their states: a new structure
        tree = jax.tree.map(_state_of, tree, is_leaf=_is_none)
        leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_none)
    structure = (treedef, tuple(is_array(leaf) for leaf in leaves))
    known = _STRUCTURES.get(structure)
    if known is None:
        known = _structure_of(tree)
        if len(_STRUCTURES) >= _STRUCTURES_KEPT:
            _STRUCTURES.clear()
        _STRUCTURES[structure] = known
    keys, skeleton, dirs = known
    return list(zip(keys, leaves, strict=True)), skeleton, dirs


def _structure_of(tree: Any) -> tuple[list[str], Any, dict[str, str]]:
    with_paths, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_none)
    keys = [jax.tree_util.keystr(path) for path, _ in with_paths]
    paths = [(key, path) for key, (path, leaf) in zip(keys, with_paths, strict=True) if is_array(leaf)]
    return keys, _skeleton(tree), keypaths.leaf_dirs(paths)


def _is_none(x: Any) -> bool:
    return x is None


def _has_state(x: Any) -> bool:
    return not is_array(x) and callable(getattr(x, "get_state", None))


def _state_of(x: Any) -> Any:
    """A data iterator (anything whose `get_state()` is a dict) as its state; other leaves as
    they are (a leaf that is not JSON-able then fails the save naming its key)."""
    state = x.get_state() if _has_state(x) else None
    return state if isinstance(state, dict) else x


def abstract(tree: Any) -> Any:
    """`tree` as a restore target: arrays as `jax.ShapeDtypeStruct`s with their sharding (numpy
    arrays and ShapeDtypeStructs as they are), every other leaf, a data iterator included, as
    None, which restores what was saved there (a whole subtree of plain values: the iterator's
    state). Like Orbax's `to_shape_dtype_struct`."""

    def leaf(x: Any) -> Any:
        if isinstance(x, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct):
            return spec_of(x)
        return None

    return jax.tree.map(leaf, tree, is_leaf=_is_none)


def _skeleton(tree: Any, path: tuple = ()) -> Any:
    """dicts stay dicts, lists and tuples become lists, other nodes dicts of their children."""
    treedef: Any = jax.tree_util.tree_structure(tree, is_leaf=_is_none)
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:
        return {"leaf": jax.tree_util.keystr(path)}
    children = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)[0]
    if isinstance(tree, list | tuple) and not hasattr(tree, "_fields"):
        return {"list": [_skeleton(child, path + (p[0],)) for p, child in children]}
    return {"dict": {key_name(p[0]): _skeleton(child, path + (p[0],)) for p, child in children}}


def key_name(key: Any) -> str:
    """A key path entry as the name a skeleton (and Orbax's parameter names) give it."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def rebuild(skeleton: Any, values: dict[str, Any]) -> Any:
    """A tree of dicts and lists from a skeleton and the restored leaves by key."""
    if "leaf" in skeleton:
        return values[skeleton["leaf"]]
    if "list" in skeleton:
        return [rebuild(child, values) for child in skeleton["list"]]
    return {name: rebuild(child, values) for name, child in skeleton["dict"].items()}


def subtree(skeleton: Any, key: str, prefix: str = "") -> Any:
    """The skeleton's node whose path is `key` (a `keystr`), or None; `prefix`: this node's."""
    if "leaf" in skeleton:
        return None
    children = enumerate(skeleton["list"]) if "list" in skeleton else skeleton["dict"].items()
    for name, child in children:
        first = next(iter(leaf_keys(child)), None)
        if first is None:
            continue
        for part in (f"[{name!r}]", f"[{name}]", f".{name}"):
            path = prefix + part
            if first.startswith(path):
                if path == key:
                    return child
                if key.startswith(path) and key[len(path)] in "[.":
                    return subtree(child, key, path)
    return None


def leaf_keys(skeleton: Any) -> list[str]:
    """The keys of the leaves under a skeleton node, in tree order."""
    if "leaf" in skeleton:
        return [skeleton["leaf"]]
    children = skeleton["list"] if "list" in skeleton else list(skeleton["dict"].values())
    return [k for c in children for k in leaf_keys(c)]


def prune(skeleton: Any, keep: set[str]) -> Any:
    """The skeleton restricted to leaves in `keep` (None when nothing is left)."""
    if "leaf" in skeleton:
        return skeleton if skeleton["leaf"] in keep else None
    if "list" in skeleton:
        items = [prune(c, keep) for c in skeleton["list"]]
        return {"list": items} if any(i is not None for i in items) else None
    kept = {n: p for n, c in skeleton["dict"].items() if (p := prune(c, keep)) is not None}
    return {"dict": kept} if kept else None


def json_value(key: str, value: Any) -> Any:
    """A non-array leaf as JSON, or a clear error."""
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        raise CheckpointError(
            f"{key}: cannot save a leaf of type {type(value).__name__}; leaves must be arrays, "
            "numbers, strings, booleans or None (JSON-able)"
        ) from None
    return value


# --- shardings ---------------------------------------------------------------------------------
def sharding_to_json(sharding: Any) -> dict[str, Any]:
    if isinstance(sharding, NamedSharding):
        mesh = sharding.mesh
        return {
            "type": "NamedSharding",
            "axis_names": list(mesh.axis_names),
            "mesh_shape": [int(n) for n in mesh.devices.shape],
            "device_ids": [int(d.id) for d in mesh.devices.flat],
            "spec": [list(p) if isinstance(p, tuple) else p for p in sharding.spec],
        }
    if isinstance(sharding, SingleDeviceSharding):
        device: Any = next(iter(sharding.device_set))
        return {"type": "SingleDeviceSharding", "device_id": int(device.id)}
    return {"type": type(sharding).__name__, "repr": repr(sharding)}


def sharding_from_json(data: dict[str, Any] | None, devices: list[Any]) -> Any:
    """The saved sharding on the current devices, or None when they are not all here."""
    if not data:
        return None
    by_id = {d.id: d for d in devices}
    if data["type"] == "NamedSharding" and all(i in by_id for i in data["device_ids"]):
        mesh_devices = np.array([by_id[i] for i in data["device_ids"]]).reshape(data["mesh_shape"])
        spec = PartitionSpec(*[tuple(p) if isinstance(p, list) else p for p in data["spec"]])
        return NamedSharding(Mesh(mesh_devices, tuple(data["axis_names"])), spec)
    if data["type"] == "SingleDeviceSharding" and data["device_id"] in by_id:
        return SingleDeviceSharding(by_id[data["device_id"]])
    return None
