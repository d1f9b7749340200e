"""A colocar manifest for a step Orbax wrote itself (runs in the controller; tensorstore, no JAX).

Orbax's `_METADATA` names every leaf (its key path and value type) but not its shape or dtype:
those come from each array's zarr metadata, opened with tensorstore (concurrently; a few ms
each). Plain scalars are read here too (0-d arrays: bytes, not bulk data). The result reads
like a manifest colocar wrote in Orbax's layout, so `restore` treats both alike; its leaves are
keyed as `jax.tree_util.keystr` would key a tree of dicts and lists (`restore` also matches a
target's leaf by its Orbax parameter name, for tuples, NamedTuples and dataclasses).
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from colocar.checkpoint.format import layout
from colocar.errors import CheckpointError

from . import names


def manifest(storage: Any, step: int | None, item_dir: str, metadata: dict[str, Any]) -> dict[str, Any]:
    """The manifest of the Orbax item at `item_dir` whose `_METADATA` is `metadata`."""
    import tensorstore as ts

    options: dict[str, Any] = {
        "item_dir": item_dir,
        "use_ocdbt": metadata.get("use_ocdbt", storage.exists(f"{item_dir}/{names.MANIFEST_OCDBT}")),
        "use_zarr3": bool(metadata.get("use_zarr3", False)),
        "store_array_data_equal_to_fill_value": bool(metadata.get("store_array_data_equal_to_fill_value")),
    }
    found: dict[str, Any] = {"format": layout.FORMAT, "array_layout": layout.ORBAX_LAYOUT, "orbax": options}
    leaves: dict[str, dict[str, Any]] = {}
    context = ts.Context(storage.context_spec())
    opened = []
    for index, (tree_key, node) in enumerate(sorted(metadata.get("tree_metadata", {}).items())):
        keys = [[k["key"], int(k["key_type"])] for k in node.get("key_metadata", [])] or _keys(tree_key)
        key = keystr(keys)
        entry: dict[str, Any] = {"index": index, "key": key, "path": keys, "dir": names.param_name(keys)}
        value_type = node.get("value_metadata", {}).get("value_type", "jax.Array")
        if value_type not in ("jax.Array", "np.ndarray", "scalar"):
            raise CheckpointError(
                f"{key}: step {step} holds an Orbax {value_type!r}; colocar restores arrays and scalars"
            )
        entry["kind"] = {"jax.Array": "array", "np.ndarray": "numpy", "scalar": "value"}[value_type]
        spec = _spec(storage, options, entry["dir"])
        opened.append((entry, ts.open(spec, context=context, open=True)))
        leaves[key] = entry
    shardings = _shardings(storage, item_dir)
    for entry, future in opened:
        _describe(entry, future, shardings, step)
    found.update(step=step, attempt="", leaves=leaves, tree=_tree([e["path"] for e in leaves.values()]))
    found["metadata"] = _step_metadata(storage, item_dir)
    return found


def keystr(keys: list[list[Any]]) -> str:
    """The `jax.tree_util.keystr` of a path of dict keys and list indices."""
    return "".join(f"[{int(k)}]" if t == names.KEY_SEQUENCE else f"[{k!r}]" for k, t in keys)


def _keys(tree_key: str) -> list[list[Any]]:
    """Keys from a `tree_metadata` key alone (Orbax before `key_metadata`): all dict keys."""
    return [[str(k), names.KEY_DICT] for k in ast.literal_eval(tree_key)]


def _spec(storage: Any, options: dict[str, Any], name: str) -> dict[str, Any]:
    item = options["item_dir"]
    if options["use_ocdbt"]:
        kvstore = {"driver": "ocdbt", "base": storage.kvstore(item), "path": name}
    else:
        kvstore = storage.kvstore(f"{item}/{name}")
    return {"driver": "zarr3" if options["use_zarr3"] else "zarr", "kvstore": kvstore}


def _describe(entry: dict[str, Any], future: Any, shardings: dict[str, Any], step: int | None) -> None:
    """Shape, dtype and chunks from the opened array; a scalar's value."""
    try:
        store = future.result()
    except Exception as e:
        raise CheckpointError(
            f"{entry['key']}: step {step}'s array {entry['dir']} cannot be opened: {e}"
        ) from None
    dtype = store.dtype.numpy_dtype.name
    shape = [int(n) for n in store.shape]
    if entry["kind"] == "value":
        value = store.read().result()
        entry["value"] = value.item()
        return
    chunks = [int(n) for n in (store.chunk_layout.read_chunk.shape or shape)]
    entry.update(
        dtype=dtype, stored_dtype=dtype, shape=shape, stored_shape=shape, chunks=chunks, inner_chunks=chunks
    )
    entry["sharding"] = shardings.get(entry["dir"]) if entry["kind"] == "array" else None


def _shardings(storage: Any, item_dir: str) -> dict[str, Any]:
    """Orbax's `_sharding` as colocar's sharding descriptions, by parameter name."""
    import base64

    try:
        body = json.loads(storage.read(f"{item_dir}/{names.SHARDING}") or b"{}")
    except ValueError:
        return {}
    found = {}
    for encoded, text in body.items():
        name = base64.urlsafe_b64decode(encoded.encode()).decode()
        sharding = json.loads(text)
        if sharding.get("sharding_type") == "NamedSharding" and sharding.get("device_mesh"):
            ids = _flat_ids(sharding["device_mesh"]["mesh"])
            spec = sharding.get("partition_spec", [])
            found[name] = {
                "type": "NamedSharding",
                "axis_names": sharding["axis_names"],
                "mesh_shape": sharding["shape"],
                "device_ids": ids,
                "spec": spec,
            }
        elif sharding.get("sharding_type") == "SingleDeviceSharding":
            number = re.search(r"(\d+)", str(sharding.get("device_str", "")))
            if number:
                found[name] = {"type": "SingleDeviceSharding", "device_id": int(number.group(1))}
    return found


def _flat_ids(mesh: Any) -> list[int]:
    if isinstance(mesh, dict):
        return [int(mesh["id"])]
    return [i for part in mesh for i in _flat_ids(part)]


def _tree(paths: list[list[list[Any]]]) -> dict[str, Any]:
    """The manifest's skeleton of dicts and lists for leaves at `paths`."""
    root: dict[Any, Any] = {}
    for keys in paths:
        node = root
        for k, _ in keys:
            node = node.setdefault(k, {})
        node[None] = keystr(keys)
    return _skeleton(
        root, paths_kinds={tuple(k for k, _ in p[:i]): p[i][1] for p in paths for i in range(len(p))}
    )


def _skeleton(node: dict[Any, Any], paths_kinds: dict[tuple, int], prefix: tuple = ()) -> dict[str, Any]:
    if None in node:
        return {"leaf": node[None]}
    children = {k: _skeleton(v, paths_kinds, prefix + (k,)) for k, v in node.items()}
    if paths_kinds.get(prefix) == names.KEY_SEQUENCE:  # the kind of this node's keys
        return {"list": [children[k] for k in sorted(children, key=int)]}
    return {"dict": children}


def _step_metadata(storage: Any, item_dir: str) -> dict[str, Any]:
    """The user's metadata of the step (`_CHECKPOINT_METADATA`'s `custom_metadata`)."""
    step_dir = item_dir.rpartition("/")[0]
    name = f"{step_dir}/{names.CHECKPOINT_METADATA}" if step_dir else names.CHECKPOINT_METADATA
    try:
        body = json.loads(storage.read(name) or b"{}")
    except ValueError:
        return {}
    return body.get("custom_metadata") or {}
