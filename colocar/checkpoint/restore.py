"""Restore: read what each host's devices need, then build global arrays (runs in the controller).

For every array leaf the target sharding (which may differ from the saved one, also in device
count) gives each device's slice; each host asks its sidecar for its distinct slices, which
tensorstore reads into arena blocks; the controller puts each slice on its device (on CPU the
device array aliases the block, which then stays leased as long as that array lives) and
assembles the global array with `jax.make_array_from_single_device_arrays`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from colocar.controller_bridge.func import colocated
from colocar.errors import CheckpointError

from .backends.reader import read_slices
from .format import tree
from .orbax import shardings
from .saves.plan import shard_bounds
from .store.storage import describe

_read = colocated(read_slices)


@dataclass
class _Leaf:
    key: str
    entry: dict[str, Any]
    shape: tuple[int, ...]
    sharding: Any  # None: a numpy leaf, read on host 0
    device_bounds: dict[Any, list[list[int]]] = field(default_factory=dict)


@dataclass
class RestoreStats:
    bytes_read: dict[int, int] = field(default_factory=dict)  # host index -> bytes
    bytes_needed: dict[int, int] = field(default_factory=dict)  # host index -> bytes of its slices


def _describe(entry: dict[str, Any]) -> str:
    dtype = f"key<{entry['impl']}>" if entry["kind"] == "prng_key" else entry["dtype"]
    return f"{dtype}{list(entry['shape'])}"


def _target_leaf(key: str, entry: dict[str, Any], target: Any, devices: list[Any], step: int | None) -> _Leaf:
    """Checks `target` (None, a ShapeDtypeStruct with a sharding, or an array) against the entry."""
    saved_shape = tuple(entry["shape"])
    if target is None:
        if entry["kind"] == "numpy":
            return _Leaf(key, entry, saved_shape, None)
        sharding = tree.sharding_from_json(entry["sharding"], devices)
        if sharding is None:
            raise CheckpointError(
                f"{key}: step {step} was saved with a sharding over devices this job does not have "
                f"({entry['sharding']}); pass a target (jax.ShapeDtypeStruct with a sharding) for it"
            )
        return _Leaf(key, entry, saved_shape, sharding)
    shape = tuple(getattr(target, "shape", ()))
    if shape != saved_shape:
        raise CheckpointError(
            f"{key}: the target has shape {list(shape)}, step {step} holds {_describe(entry)}"
        )
    if entry["kind"] == "prng_key":
        if not tree.is_prng_key(target) or target.dtype != jax.random.key(0, impl=entry["impl"]).dtype:
            raise CheckpointError(
                f"{key}: the target is {target.dtype}, step {step} holds {_describe(entry)}"
            )
    elif tree.is_prng_key(target) or np.dtype(target.dtype).name != entry["dtype"]:
        raise CheckpointError(f"{key}: the target is {target.dtype}, step {step} holds {_describe(entry)}")
    if isinstance(target, np.ndarray | np.generic):
        return _Leaf(key, entry, saved_shape, None)
    sharding = getattr(target, "sharding", None)
    if sharding is None:
        raise CheckpointError(
            f"{key}: the target has no sharding; give jax.ShapeDtypeStruct(..., sharding=...)"
        )
    return _Leaf(key, entry, saved_shape, sharding)


Requests = dict[int, list[tuple[int, str, list[list[int]]]]]  # host -> [(leaf index, dtype, bounds)]
Reads = dict[int, list[tuple[dict[str, Any], str, list[list[int]]]]]  # the same, by tensorstore spec
Where = dict[tuple[str, int, str], int]  # (key, host, bounds) -> request number on that host


def _expand_subtrees(manifest: dict[str, Any], targets: dict[str, Any]) -> dict[str, Any]:
    """A None target at a saved subtree (e.g. the data iterator's state, saved as several
    leaves) stands for each of its leaves, restored as saved."""
    saved = manifest["leaves"]
    expanded: dict[str, Any] = {}
    for key, target in targets.items():
        node = None if key in saved or target is not None else tree.subtree(manifest["tree"], key)
        if node is None:
            expanded[key] = target
        else:
            expanded.update(dict.fromkeys(tree.leaf_keys(node)))
    return expanded


def _subtrees(manifest: dict[str, Any], targets: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """The values of `targets`' keys, with each expanded subtree rebuilt as saved."""
    out = {}
    for key in targets:
        if key in values:
            out[key] = values[key]
        else:
            out[key] = tree.rebuild(tree.subtree(manifest["tree"], key), values)
    return out


def _split_targets(
    saved: dict[str, Any], targets: dict[str, Any], devices: Any, step: int | None
) -> tuple[dict[str, Any], list[_Leaf]]:
    """The targets' values stored in the manifest itself, and the leaves to read from storage."""
    values: dict[str, Any] = {}
    leaves: list[_Leaf] = []
    for key, target in targets.items():
        entry = saved.get(key)
        if entry is None:
            raise CheckpointError(f"{key}: not in step {step} (it holds {sorted(saved)[:20]})")
        if entry["kind"] == "value":
            values[key] = entry["value"]
        else:
            leaves.append(_target_leaf(key, entry, target, devices, step))
    return values, leaves


def _placements(leaf: _Leaf, cluster: Any) -> list[tuple[Any, Any, list[list[int]]]]:
    """(host, device, bounds in the stored array) of each piece of `leaf` this process reads:
    one piece on the first host for a numpy leaf, else one per device of this process."""
    stored_shape = tuple(leaf.entry["stored_shape"])
    if leaf.sharding is None:
        return [(cluster.hosts[0], None, [[0, n] for n in stored_shape])]
    placements = []
    for device, index in leaf.sharding.devices_indices_map(leaf.shape).items():
        if device.process_index != jax.process_index():
            continue  # multi-controller: another process reads the slices of its devices
        host = cluster.host_of(device)
        if host is None:
            raise CheckpointError(
                f"{leaf.key}: device {device} of the target (or of the saved sharding, without a "
                "target) belongs to no host of the cluster; pass a target sharded over its devices"
            )
        placements.append((host, device, shard_bounds(index, stored_shape)))
    return placements


def _plan(leaves: list[_Leaf], cluster: Any, stats: RestoreStats) -> tuple[Requests, Where]:
    """Per host its distinct slices, in request order (a slice two devices share is read once);
    records each leaf's bounds by device and the bytes each host will read in `stats`."""
    requests: Requests = {h.index: [] for h in cluster.hosts}
    where: Where = {}
    for leaf in leaves:
        entry = leaf.entry
        itemsize = np.dtype(entry["stored_dtype"]).itemsize
        for host, device, bounds in _placements(leaf, cluster):
            token = (leaf.key, host.index, repr(bounds))
            if token not in where:
                where[token] = len(requests[host.index])
                requests[host.index].append((entry["index"], entry["stored_dtype"], bounds))
                size = int(np.prod([b - a for a, b in bounds], dtype=np.int64)) * itemsize
                stats.bytes_needed[host.index] = stats.bytes_needed.get(host.index, 0) + size
            leaf.device_bounds[device] = bounds
    return requests, where


def _by_spec(manifest: dict[str, Any], requests: Requests, spec_of: Any) -> Reads:
    """The requests naming each leaf's array by the tensorstore spec that opens it."""
    leaves = manifest["leaves"].values()
    specs = {e["index"]: spec_of(e) for e in leaves if e["kind"] != "value"}
    return {h: [(specs[i], dtype, bounds) for i, dtype, bounds in r] for h, r in requests.items()}


def _read_all(
    url: str,
    step: int | None,
    requests: Reads,
    cluster: Any,
    storage_timeout: float,
    stats: RestoreStats,
) -> dict[int, list[np.ndarray]]:
    """Every host reads its slices at once (on its sidecar);
    host -> arrays in request order. Records the bytes each host read in `stats`. When one
    host fails, every other host's read is given up (cancelled, or its arrays freed): a failed
    restore keeps no block."""
    futures: dict[int, Any] = {}
    results: dict[int, list[np.ndarray]] = {}
    future: Any = None
    try:
        for host in cluster.hosts:
            if requests[host.index]:
                futures[host.index] = _read.on(host).submit(url, requests[host.index], storage_timeout)
        for h, future in futures.items():
            results[h] = _host_result(step, h, future, stats)
        return results
    except BaseException:
        for pending in futures.values():
            pending.give_up()
        futures, results, future = {}, {}, None  # the error's frames must not keep hosts' arrays
        raise


def _host_result(step: int | None, host_index: int, future: Any, stats: RestoreStats) -> list[np.ndarray]:
    try:
        arrays, nbytes = future.result()
    except Exception as e:
        raise CheckpointError(f"restoring step {step} on host {host_index} failed: {describe(e)}") from e
    stats.bytes_read[host_index] = nbytes
    return list(arrays)


def restore_leaves(
    url: str,
    step: int | None,
    manifest: dict[str, Any],
    targets: dict[str, Any],
    cluster: Any,
    storage_timeout: float,
    spec_of: Any,
) -> tuple[dict[str, Any], RestoreStats]:
    """The values of the keys in `targets` (key -> target leaf or None) at `step`; None at a
    saved subtree restores that whole subtree as saved. `spec_of(entry)`: the tensorstore spec
    of an array leaf's entry (its layout's `read_spec`)."""
    # Saved shardings come back over the job's devices (under multi-controller JAX, every
    # process's): each process then reads only its own devices' slices (`_placements`).
    wanted = _expand_subtrees(manifest, targets)
    values, leaves = _split_targets(manifest["leaves"], wanted, jax.devices(), step)
    stats = RestoreStats()
    requests, where = _plan(leaves, cluster, stats)
    results = _read_all(url, step, _by_spec(manifest, requests, spec_of), cluster, storage_timeout, stats)
    for leaf in leaves:
        values[leaf.key] = _assemble(leaf, cluster, where, results)
    return _subtrees(manifest, targets, values), stats


def _assemble(leaf: _Leaf, cluster: Any, where: Where, results: dict[int, list[np.ndarray]]) -> Any:
    def piece(device: Any) -> np.ndarray:
        host = cluster.hosts[0] if device is None else cluster.host_of(device)
        return results[host.index][where[(leaf.key, host.index, repr(leaf.device_bounds[device]))]]

    if leaf.sharding is None:
        return np.array(piece(None))  # a host copy: numpy leaves do not pin arena blocks
    devices = list(leaf.device_bounds)
    arrays = jax.device_put([piece(d) for d in devices], devices)
    if leaf.entry["kind"] == "prng_key":
        arrays = [jax.random.wrap_key_data(a, impl=leaf.entry["impl"]) for a in arrays]
    return jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, arrays)


def restore_tree(
    step: int | None, manifest: dict[str, Any], target: Any, keys: list[str] | None, cluster: Any, where: Any
) -> tuple[Any, RestoreStats]:
    """`CheckpointManager.restore`'s tree: `target`'s (its leaves matched to the saved ones by
    key path, in Orbax's layout also by parameter name), or without one the saved tree (only
    its top-level `keys`, when given). `where`: (url, spec_of, storage timeout)."""
    url, spec_of, storage_timeout = where
    if target is not None:
        leaves, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=tree._is_none)
        names = shardings.match_keys([path for path, _ in leaves], manifest)
        targets = {key: leaf for key, (_, leaf) in zip(names, leaves, strict=True)}
        values, stats = restore_leaves(url, step, manifest, targets, cluster, storage_timeout, spec_of)
        return jax.tree_util.tree_unflatten(treedef, [values[k] for k in names]), stats
    wanted = set(manifest["leaves"])
    if keys is not None:
        prefixes = tuple(jax.tree_util.keystr((jax.tree_util.DictKey(k),)) for k in keys)
        wanted = {k for k in wanted if k.startswith(prefixes)}
        missing = [k for k, p in zip(keys, prefixes, strict=True) if not any(w.startswith(p) for w in wanted)]
        if missing:
            raise CheckpointError(f"keys {missing} are not in step {step}")
    values, stats = restore_leaves(
        url, step, manifest, dict.fromkeys(wanted), cluster, storage_timeout, spec_of
    )
    skeleton = tree.prune(manifest["tree"], wanted) if keys is not None else manifest["tree"]
    return (tree.rebuild(skeleton, values) if skeleton is not None else None), stats
