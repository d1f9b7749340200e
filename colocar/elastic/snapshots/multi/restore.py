"""A multi-controller restore: each process builds its addressable devices' slices (controller).

The processes exchange which shards each saved (its record's list), so every one knows the
whole layout of the snapshot. Each device slice of the target is then covered as the
single-controller restore covers it (`snapshots.slices.sources`), with processes for hosts: by this
process's own shards when they cover it (the same sharding: read in place, `read_own`), else
by parts of the other processes' shards, which this process's keeper reads from theirs keeper
to keeper and stitches (`read_across`). A closing exchange keeps every keeper serving reads
until all processes are done, and fails the restore everywhere if it failed anywhere: whatever
fails in one process (its keeper unreadable, a shard read), it still takes both exchanges.
"""

from __future__ import annotations

import json
import pickle
from collections import defaultdict
from typing import Any

import jax
import numpy as np

from colocar.checkpoint.saves.plan import shard_bounds
from colocar.errors import SnapshotError

from ..keepers.held import Key, key_of
from ..slices import check_covered, sources, volume
from . import agree

Request = tuple[int, str, Any, list[tuple[int, Any]]]  # leaf, dtype, bounds, [(process, part)]


def restore(snaps: Any, step: int, attempt: str, target: Any) -> Any:
    """Snapshot (step, attempt), refilled, on `target` (a pytree of ShapeDtypeStructs or arrays
    with shardings, any layout of the saved shapes); a collective."""
    record: dict[str, Any] | None = None
    mine, error = None, ""
    absent = agree.absent(snaps._summaries, step)
    try:  # whatever fails here, this process still takes part in both exchanges
        record, mine = _held(snaps.keeper.holdings_by_source()[step], attempt, absent)
    except Exception as e:  # noqa: BLE001 - every process hears of it below
        error = f"process {snaps.process}: reading its keeper: {type(e).__name__}: {e}"
    said = snaps._exchange.allgather(json.dumps(mine), f"layout of step {step}")
    try:
        if error:
            raise SnapshotError(error)
        if record is None or mine is None:
            raise SnapshotError(
                f"snapshot step {step}: this process's sidecar lacks its shards after the refill"
            )
        where: dict[Key, list[int]] = defaultdict(list)
        for q, listed in enumerate(json.loads(s) for s in said):
            for leaf, bounds in listed or []:
                if q not in where[key_of(leaf, bounds)]:
                    where[key_of(leaf, bounds)].append(q)
        out = _build(snaps, step, attempt, record, where, target, absent)
    except Exception as e:  # noqa: BLE001 - every process hears of it below
        error = error or f"process {snaps.process}: {e}"
    done = snaps._exchange.allgather(error, f"restore of step {step}")
    failed = [s for s in done if s]
    if failed:
        raise SnapshotError(f"restoring snapshot step {step} failed: {failed[0]}")
    return out


def _held(holdings: dict[str, Any], attempt: str, absent: list[int]) -> tuple[dict[str, Any] | None, Any]:
    """This process's record of the step and the shards its keeper serves: its own, and its
    replicas of the `absent` sources (hosts the job restarted without); (None, None) when its
    own are not all here."""
    record = agree.complete(*holdings["own"])
    if record is None or holdings["attempt"] != attempt:
        return None, None
    shards = list(record["shards"])
    for source in absent:
        replica = agree.complete(*holdings["replicas"].get(source, (None, [])))
        shards += replica["shards"] if replica is not None else []
    return record, shards


def _build(
    snaps: Any,
    step: int,
    attempt: str,
    record: dict[str, Any],
    where: dict[Key, list[int]],
    target: Any,
    absent: list[int],
) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=lambda x: x is None)
    values = pickle.loads(record["values"])
    out: list[Any] = []
    arrays: dict[int, tuple[str, Any, list[tuple[Any, int]]]] = {}  # index -> key, sharding, parts
    requests: list[Request] = []
    load: dict[int, int] = {}
    for i, (path, wanted) in enumerate(leaves):
        key = jax.tree_util.keystr(path)
        out.append(values.get(key))
        if key in values:
            continue
        saved = _saved(record, key, wanted, step)
        shape = tuple(saved["shape"])
        arrays[i] = (key, wanted.sharding, [])
        for device, index in wanted.sharding.addressable_devices_indices_map(shape).items():
            bounds = key_of(saved["index"], shard_bounds(index, shape))[1]
            parts = sources(snaps.process, saved["index"], bounds, where, load)
            check_covered(step, saved["index"], bounds, [p for _, p in parts])
            arrays[i][2].append((device, len(requests)))
            requests.append((saved["index"], saved["dtype"], bounds, parts))
    got = _read(snaps, step, attempt, requests, absent)
    for i, (key, sharding, placed) in arrays.items():
        shape = tuple(record["leaves"][key]["shape"])
        dtype = np.dtype(record["leaves"][key]["dtype"])
        singles = [jax.device_put(np.asarray(got[r], dtype), d) for d, r in placed]
        out[i] = jax.make_array_from_single_device_arrays(shape, sharding, singles)
    return jax.tree_util.tree_unflatten(treedef, out)


def _saved(record: dict[str, Any], key: str, wanted: Any, step: int) -> dict[str, Any]:
    """The saved leaf `key`, checked against its target (the same shape, and a sharding)."""
    saved = record["leaves"].get(key)
    if saved is None:
        raise SnapshotError(f"{key}: not in snapshot step {step} (it holds {record['keys'][:20]})")
    sharding = getattr(wanted, "sharding", None)
    if sharding is None or tuple(wanted.shape) != tuple(saved["shape"]):
        raise SnapshotError(
            f"{key}: the target needs the saved shape {saved['shape']} and a sharding "
            f"(got {getattr(wanted, 'shape', None)}, {sharding})"
        )
    return dict(saved)


def _read(
    snaps: Any, step: int, attempt: str, requests: list[Request], absent: list[int]
) -> list[np.ndarray]:
    """The slices: read in place when this process's keeper covers them all (the saved
    layout), else stitched by its keeper from its own and the peers' keepers (the bytes of
    the peers' parts count in stats' "fetched_bytes"); each keeper serves its own shards and
    its replicas of the `absent` sources."""
    me = snaps.process
    if all(p == me for _, _, _, parts in requests for p, _ in parts):
        wanted = [(leaf, d, b) for leaf, d, b, _ in requests]
        return list(snaps.keeper.read_own(step, attempt, wanted, absent))
    snaps._stats["fetched_bytes"] = snaps._stats.get("fetched_bytes", 0) + sum(
        volume(part) * np.dtype(d).itemsize for _, d, _, parts in requests for p, part in parts if p != me
    )
    peers = {q: tuple(_target(snaps, q)) for q in {p for *_, parts in requests for p, _ in parts} if q != me}
    wire = [
        (leaf, d, [list(x) for x in b], [(p, [list(x) for x in part]) for p, part in parts])
        for leaf, d, b, parts in requests
    ]
    return list(snaps.keeper.read_across(step, attempt, wire, peers, absent))


def _target(snaps: Any, process: int) -> Any:
    from ..keepers.peers import Target

    return Target(process, snaps._addresses[process], snaps._keeper_name(process))
