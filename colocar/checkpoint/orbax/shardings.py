"""The controller's part of Orbax's layout: each array's sharding as Orbax's `_sharding` writes
it, added to the manifest entries of a save (runs in the controller; JAX)."""

from __future__ import annotations

import json
from typing import Any

import jax
from jax.sharding import NamedSharding, SingleDeviceSharding

from colocar.checkpoint.format import tree


def param_name(path: tuple) -> str:
    """Orbax's parameter name of a leaf at a `jax.tree_util` key path: its keys joined by dots."""
    return ".".join(tree.key_name(key) for key in path)


def match_keys(paths: list[tuple], manifest: dict[str, Any]) -> list[str]:
    """The manifest's leaf key for each target leaf path: its `keystr`, or in Orbax's layout
    the leaf of the same parameter name (a NamedTuple's field, a tuple's index)."""
    keys = [jax.tree_util.keystr(path) for path in paths]
    if manifest.get("array_layout") != "orbax":
        return keys
    by_name = {e.get("dir"): k for k, e in manifest["leaves"].items()}
    return [
        key if key in manifest["leaves"] else by_name.get(param_name(path), key)
        for key, path in zip(keys, paths, strict=True)
    ]


def sharding_json(sharding: Any) -> str | None:
    """The sharding as Orbax's `_sharding` describes it (None: a kind Orbax does not record)."""
    if isinstance(sharding, NamedSharding):
        mesh = sharding.mesh
        body: dict[str, Any] = {
            "sharding_type": "NamedSharding",
            "shape": [int(n) for n in mesh.devices.shape],
            "axis_names": list(mesh.axis_names),
        }
        if getattr(mesh, "axis_types", None) is not None:
            body["axis_types"] = [str(t) for t in mesh.axis_types]
        body["partition_spec"] = [list(p) if isinstance(p, tuple) else p for p in sharding.spec]
        ids = jax.tree.map(lambda d: {"id": int(d.id)}, mesh.devices.tolist())
        body["device_mesh"] = {"mesh": ids}
        return json.dumps(body)
    if isinstance(sharding, SingleDeviceSharding):
        device = next(iter(sharding.device_set))
        return json.dumps({"sharding_type": "SingleDeviceSharding", "device_str": str(device)})
    return None


def add_shardings(leaves: dict[str, dict[str, Any]], named: list[tuple[str, Any]]) -> None:
    """Records each JAX array leaf's sharding as Orbax's `_sharding` has it."""
    for key, leaf in named:
        entry = leaves.get(key)
        if entry is not None and entry["kind"] in ("array", "prng_key"):
            entry["orbax_sharding"] = sharding_json(getattr(leaf, "sharding", None))
