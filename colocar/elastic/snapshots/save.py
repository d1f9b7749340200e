"""Storage saves from snapshots: a snapshot's blocks written by the checkpoint writers (controller).

`SnapshotBlocks` is a `checkpoint.saves.from_blocks.Held`: it plans a checkpoint of snapshot `step`
from its record (the leaves' metadata, the plain values, which host holds which shard) cut into
the manager's chunks, and asks each host's keeper to hand that host's writer views of its own
blocks (`SnapshotKeeper.write_to`: both live in the sidecar). No device-to-host copy happens
again and no arena block is taken; the views keep the blocks until written even when a later
snapshot drops them. A host that held shards and is lost (or not among the manager's hosts)
fails the save with CheckpointError before anything is committed.

`save_if_taken` lets the elastic manager's storage tier use a snapshot just taken of the very
same arrays (matched by identity: jax arrays never change; a tree with numpy leaves, which can
change in place, is saved from the devices).
"""

from __future__ import annotations

import logging
import pickle
import weakref
from typing import Any

import jax
import numpy as np

from colocar.checkpoint.format import layout, tree
from colocar.checkpoint.saves import plan as save
from colocar.checkpoint.saves.from_blocks import Held
from colocar.errors import CheckpointError, SnapshotError

log = logging.getLogger("colocar.elastic")
_OPEN: weakref.WeakSet[Any] = weakref.WeakSet()  # every open Snapshots of this process


class SnapshotBlocks(Held):
    """Snapshot `step` (its `record`) as the source of a checkpoint save."""

    def __init__(self, snaps: Any, step: int, record: dict[str, Any]):
        self.snaps, self.step, self.record = snaps, step, record
        self._holder: dict[int, int] = {}  # the manager's host index -> the snapshots' one

    def plan(self, cluster: Any, chunk_bytes: int) -> tuple[save.Plan, Any]:
        record, result = self.record, save.Plan()
        values = pickle.loads(record["values"])
        extents: dict[int, list[int]] = {}
        for shards in record["shards"].values():
            for leaf, bounds in shards:
                old = extents.setdefault(leaf, [0] * len(bounds))
                extents[leaf] = [max(n, b - a) for n, (a, b) in zip(old, bounds, strict=True)]
        leaf_of: dict[int, tuple[int, tuple[int, ...], np.dtype]] = {}  # snapshot leaf -> checkpoint's
        for index, key in enumerate(record["keys"]):
            if key in values:
                value = tree.json_value(key, values[key])
                result.leaves[key] = {"kind": "value", "index": index, "key": key, "value": value}
                continue
            entry = dict(record["leaves"][key])
            dtype = np.dtype(entry["stored_dtype"])
            shard_shape = tuple(extents.get(entry["index"]) or entry["stored_shape"])
            outer, inner = layout.chunk_shapes(shard_shape, dtype.itemsize, chunk_bytes)
            leaf_of[entry["index"]] = (index, outer, dtype)
            entry.update(index=index, chunks=list(outer), inner_chunks=list(inner))
            result.leaves[key] = entry
        for h, shards in record["shards"].items():
            target = self._manager_host(cluster, h) if shards else None
            for leaf, bounds in shards:
                index, outer, dtype = leaf_of[leaf]
                for piece in save._chunk_grid([list(b) for b in bounds], outer):
                    shape = tuple(b - a for a, b in piece)
                    result.pieces.setdefault(target, []).append(  # type: ignore[arg-type]
                        save.Piece(index, piece, (leaf, bounds), (), shape, dtype)
                    )
        result.pieces.setdefault(cluster.hosts[0].index, [])
        return result, record["tree"]

    def _manager_host(self, cluster: Any, h: int) -> int:
        """The manager's index of snapshot host `h`, which must be alive to hand its blocks over."""
        host = next(x for x in self.snaps.cluster.hosts if x.index == h)
        if host.connection.session.lost is not None:
            raise CheckpointError(
                f"saving snapshot step {self.step}: host {h} ({host.name}) holding its shards is lost "
                f"({host.connection.session.lost}); save from the devices, or restore onto the "
                "survivors first"
            )
        mine = [x.index for x in cluster.hosts if x.connection is host.connection]
        if not mine:
            raise CheckpointError(
                f"saving snapshot step {self.step}: host {h} ({host.name}) holding its shards is not "
                "a host of the checkpoint manager's cluster"
            )
        self._holder[mine[0]] = h
        return mine[0]

    def hand_over(self, host: int, writer: Any, step: int, attempt: str, pieces: list[save.Piece]) -> int:
        keeper = self.snaps._keeper(self._holder[host])
        items = [(p.leaf, p.bounds, p.source[0], [list(b) for b in p.source[1]]) for p in pieces]
        try:
            return int(keeper.write_to(self.step, self.record["attempt"], step, attempt, items))
        except Exception as e:
            raise CheckpointError(
                f"saving snapshot step {self.step} as step {step}: host {self._holder[host]} could not "
                f"hand its blocks to its writer: {type(e).__name__}: {e}"
            ) from e


def record_of(snaps: Any, step: int) -> dict[str, Any]:
    """The record of snapshot `step`: of a take by `snaps`, else committed in the keepers."""
    record = snaps._records.get(step)
    if record is None:
        from .restore import records, survey

        found = records(survey(snaps._keepers, snaps._live(None))).get(step)
        record = found[0] if found else None
    if record is None:
        raise SnapshotError(f"no snapshot of step {step} is held (taken: {sorted(snaps._records)})")
    return record


def save_to(snaps: Any, manager: Any, step: int, metadata: dict[str, Any] | None) -> bool:
    """Snapshot `step` saved through `manager`; a lost holder fails it before storage is touched."""
    held = SnapshotBlocks(snaps, step, record_of(snaps, step))
    for h, shards in held.record["shards"].items():
        if shards:
            held._manager_host(manager.cluster, h)
    return bool(manager.save_held(step, held, metadata=metadata))


# --- the elastic storage tier: a snapshot of the very same arrays -----------------------------
def leaves(state: Any) -> list[Any]:
    """The leaves of `state` in tree order, as a snapshot records them."""
    return [leaf for _, leaf in tree.flatten(state)[0]]


def remember(leaves: list[Any]) -> list[Any]:
    """What `same` compares, of a state's `leaves`: a weak reference per jax.Array, False for a
    numpy leaf (it may change in place: never matched), the value of a plain leaf."""
    out: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, jax.Array):
            out.append(weakref.ref(leaf))
        else:
            out.append(False if tree.is_array(leaf) else ("value", leaf))
    return out


def same(kept: list[Any], state: Any) -> bool:
    now = leaves(state)
    if len(now) != len(kept):
        return False
    for was, leaf in zip(kept, now, strict=True):
        if was is False or (isinstance(was, weakref.ref) and was() is not leaf):
            return False
        if isinstance(was, tuple) and (tree.is_array(leaf) or not _equal(was[1], leaf)):
            return False
    return True


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:  # noqa: BLE001 - a value without a plain equality: not the same
        return False


def save_if_taken(manager: Any, step: int, state: Any, metadata: dict[str, Any]) -> bool | None:
    """Saves `step` from an open `Snapshots` whose last take was `step` of these very arrays,
    over the manager's hosts; None when there is none (save from the devices), also when that
    snapshot was abandoned (a failed replication dropped its blocks), before or while they
    were handed to the writers (that attempt failed before it counted): the save does not
    fail with the snapshot."""
    for snaps in list(_OPEN):
        taken = getattr(snaps, "_taken", None)
        if snaps._closed or taken is None or taken[0] != step or not same(taken[1], state):
            continue
        snaps._committer.wait_handed(step)
        if snaps._committer.abandoned(step):
            continue
        connections = {id(h.connection) for h in manager.cluster.hosts}
        if any(id(h.connection) not in connections for h in snaps.cluster.hosts if h.index in snaps._keepers):
            continue
        try:
            return snaps.save_to(manager, step, metadata=metadata)
        except CheckpointError as e:
            if not snaps._committer.abandoned(step):
                raise
            log.warning("saving step %d from its snapshot: %s; it was abandoned: from the devices", step, e)
    return None
