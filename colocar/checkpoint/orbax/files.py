"""The contents of Orbax's small files, made from a colocar manifest (no JAX).

The primary writer makes them at commit (`commit`): `_METADATA` (the item's tree; colocar's
whole manifest rides in its `custom_metadata`, so that a restore by colocar gets back what
Orbax's tree cannot hold: strings, None, PRNG key types, lists), `_sharding`,
`array_metadatas/process_<h>` and the step's `_CHECKPOINT_METADATA` (the user's metadata is
Orbax's `custom_metadata`). Leaves Orbax can hold are in its tree: arrays, and numbers as
Orbax's `scalar` values (0-d arrays the primary writes at commit).
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any

from colocar.checkpoint.format import layout
from colocar.errors import CheckpointError

from . import names

VALUE_TYPES = {"array": "jax.Array", "prng_key": "jax.Array", "numpy": "np.ndarray", "scalar": "scalar"}


def annotate(manifest: dict[str, Any], item: str = names.ITEM) -> dict[str, Any]:
    """Marks a save's manifest as Orbax's layout: every leaf gets its Orbax key path (`path`,
    from the manifest's tree) and its parameter name (`dir`, the array's name in the OCDBT
    database). Refuses two leaves with one name (`{"a.b": x}` and `{"a": {"b": y}}`)."""
    seen: dict[str, str] = {}
    for key, keys in _key_paths(manifest["tree"], []):
        entry = manifest["leaves"][key]
        name = names.param_name(keys) if keys else "@root"
        if name in seen:
            raise CheckpointError(
                f"{key} and {seen[name]} are both {name!r} in Orbax's layout; rename one, or save with "
                "layout='colocar'"
            )
        seen[name] = key
        entry.update(path=keys, dir=name)
    manifest.update(
        array_layout=layout.ORBAX_LAYOUT, orbax={"item": item, "use_ocdbt": True, "use_zarr3": True}
    )
    return manifest


def _key_paths(node: dict[str, Any], keys: list[list[Any]]) -> list[tuple[str, list[list[Any]]]]:
    """(leaf key, [[key, key_type], ...]) of every leaf under a manifest's tree node."""
    if "leaf" in node:
        return [(node["leaf"], keys)]
    if "list" in node:
        children = [([str(i), names.KEY_SEQUENCE], c) for i, c in enumerate(node["list"])]
    else:
        children = [([name, names.KEY_DICT], c) for name, c in node["dict"].items()]
    return [found for key, child in children for found in _key_paths(child, keys + [key])]


def scalar_dtype(value: Any) -> str | None:
    """The dtype Orbax stores a plain value with, or None when Orbax's tree cannot hold it."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int64" if -(2**63) <= value < 2**63 else None
    if isinstance(value, float):
        return "float64"
    return None


def scalars(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The manifest's plain values that are Orbax scalars (with their Orbax key paths)."""
    return [
        e
        for e in manifest["leaves"].values()
        if e["kind"] == "value" and "path" in e and scalar_dtype(e["value"]) is not None
    ]


def array_entries(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The manifest's array leaves (every kind but plain values)."""
    return [e for e in manifest["leaves"].values() if e["kind"] != "value"]


def sharding_of(sharding: dict[str, Any] | None) -> str | None:
    """colocar's description of a NamedSharding as Orbax's `_sharding` entry (None for others:
    Orbax then needs a target sharding for that array, as colocar does)."""
    if not sharding or sharding.get("type") != "NamedSharding":
        return None
    shape, ids = sharding["mesh_shape"], iter(sharding["device_ids"])

    def mesh(dims: list[int]) -> Any:
        return (
            [{"id": next(ids)} for _ in range(dims[0])]
            if len(dims) == 1
            else [mesh(dims[1:]) for _ in range(dims[0])]
        )

    body = {
        "sharding_type": "NamedSharding",
        "shape": shape,
        "axis_names": sharding["axis_names"],
        "partition_spec": sharding["spec"],
        "device_mesh": {"mesh": mesh(shape)},
    }
    return json.dumps(body)


def item_metadata(manifest: dict[str, Any]) -> bytes:
    """`_METADATA`: every array and scalar leaf by Orbax's key, the storage options, and
    colocar's manifest in `custom_metadata`."""
    tree: dict[str, Any] = {}
    for entry in array_entries(manifest) + scalars(manifest):
        kind = entry["kind"] if entry["kind"] != "value" else "scalar"
        value: dict[str, Any] = {"value_type": VALUE_TYPES[kind], "skip_deserialize": False}
        if kind in ("array", "prng_key"):
            value["write_shape"] = list(entry["chunks"])
        tree[names.tree_key(entry["path"])] = {
            "key_metadata": names.key_metadata(entry["path"]),
            "value_metadata": value,
        }
    body = {
        "tree_metadata": tree,
        "use_ocdbt": True,
        "use_zarr3": True,
        "store_array_data_equal_to_fill_value": True,  # without it Orbax reads a missing chunk as 0
        "custom_metadata": {names.COLOCAR: manifest},
    }
    return json.dumps(body).encode()


def shardings(manifest: dict[str, Any]) -> bytes:
    """`_sharding`: base64url(parameter name) -> the sharding as Orbax describes it (a JSON string)."""
    body = {
        base64.urlsafe_b64encode(e["dir"].encode()).decode(): e["orbax_sharding"]
        for e in array_entries(manifest)
        if e.get("orbax_sharding")
    }
    return json.dumps(body).encode()


def array_metadatas(manifest: dict[str, Any]) -> bytes:
    """`array_metadatas/process_<h>`: the chunk shape every JAX array was written with."""
    body = [
        {
            "array_metadata": {
                "param_name": e["dir"],
                "write_shape": list(e["chunks"]),
                "chunk_shape": list(e["chunks"]),
                "ext_metadata": None,
            }
        }
        for e in array_entries(manifest)
        if e["kind"] in ("array", "prng_key")
    ]
    return json.dumps({"array_metadatas": body}).encode()


def checkpoint_metadata(manifest: dict[str, Any], item: str) -> bytes:
    """`_CHECKPOINT_METADATA` of the step: its one item's handler and the user's metadata."""
    now = time.time_ns()
    body = {
        "item_handlers": {item: names.HANDLER},
        "metrics": {},
        "performance_metrics": {},
        "init_timestamp_nsecs": int(manifest.get("time", now / 1e9) * 1e9),
        "commit_timestamp_nsecs": now,
        "custom_metadata": manifest.get("metadata") or {},
    }
    return json.dumps(body).encode()
