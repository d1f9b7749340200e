"""Storage saves from multi-controller snapshots: each process's sidecar writes its part (controller).

At each take a process records, besides its shards, the manifest entries a checkpoint of the
state needs (`storage_fields`: as `CheckpointManager.save` plans them) and which of its shards
are replica 0 (`writes`): JAX gives each distinct shard exactly one replica 0, so every shard
is written once, by one process, as a multi-controller `CheckpointManager.save` writes it.
`MultiBlocks` is the `checkpoint.saves.from_blocks.Held` of one process: it cuts those shards into
the manager's chunks and has its keeper hand its sidecar's writer views of its own blocks;
the leader (process 0) also writes the numpy leaves, kept pickled in the record. The manager
runs the usual attempt, manifest and commit protocol over all processes. `omit`: top-level keys
of the snapshot left out of the checkpoint (the elastic manager's bookkeeping leaf, which a
save from the devices does not hold either).
"""

from __future__ import annotations

import pickle
from typing import Any

import jax
import numpy as np

from colocar.checkpoint.format import layout, tree
from colocar.checkpoint.saves import plan as save
from colocar.checkpoint.saves.from_blocks import Held
from colocar.errors import CheckpointError, SnapshotError

from . import agree

WHOLE_SHARD = 1 << 62  # plan's chunk limit: one piece per shard (the chunks are cut at save time)


def storage_fields(named: list[tuple[str, Any]], dirs: dict[str, str], cluster: Any) -> dict[str, Any]:
    """{"manifest": entries of the array leaves by key, "writes": [(leaf, bounds)] of this
    process's replica-0 shards}, leaf indices those of `named` (the record's)."""
    arrays = [(k, v) for k, v in named if tree.is_array(v)]
    index_of = {k: i for i, (k, _) in enumerate(named)}
    planned = save.plan(arrays, dirs, cluster, WHOLE_SHARD)
    manifest = {k: {**e, "index": index_of[k]} for k, e in planned.leaves.items()}
    writes = [
        (index_of[arrays[p.leaf][0]], p.bounds)
        for pieces in planned.pieces.values()
        for p in pieces
        if isinstance(p.source, jax.Array)
    ]
    return {"manifest": manifest, "writes": writes}


class MultiBlocks(Held):
    """This process's part of snapshot `step` (its `record`) as the source of a checkpoint save."""

    def __init__(self, snaps: Any, step: int, record: dict[str, Any], omit: tuple[str, ...] = ()):
        self.snaps, self.step, self.record, self.omit = snaps, step, record, omit
        self.values = pickle.loads(record["values"])

    def plan(self, cluster: Any, chunk_bytes: int) -> tuple[save.Plan, Any]:
        record, result = self.record, save.Plan()
        host = cluster.hosts[0].index
        outer_of: dict[int, tuple[tuple[int, ...], np.dtype]] = {}
        omitted = {jax.tree_util.keystr((jax.tree_util.DictKey(k),)) for k in self.omit}
        for index, key in enumerate(record["keys"]):
            if key in omitted:
                continue
            entry = dict(record["manifest"].get(key) or {})
            if not entry:  # a plain value
                value = tree.json_value(key, self.values[key])
                result.leaves[key] = {"kind": "value", "index": index, "key": key, "value": value}
                continue
            dtype = np.dtype(entry["stored_dtype"])
            outer, inner = layout.chunk_shapes(tuple(entry["chunks"]), dtype.itemsize, chunk_bytes)
            entry.update(chunks=list(outer), inner_chunks=list(inner))
            result.leaves[key] = entry
            outer_of[index] = (outer, dtype)
            if entry["kind"] == "numpy" and self.snaps.process == 0:  # the leader writes host data
                shape = [[0, int(n)] for n in entry["stored_shape"]]
                self._cut(result, host, index, shape, ("value", key), outer, dtype)
        for leaf, bounds in record["writes"]:
            self._cut(result, host, leaf, bounds, ("block", leaf, bounds), *outer_of[leaf])
        result.pieces.setdefault(host, [])
        return result, self._skeleton()

    def _skeleton(self) -> Any:
        """The record's tree skeleton without the omitted top-level keys."""
        skeleton = self.record["tree"]
        if not self.omit or "dict" not in skeleton:
            return skeleton
        return {"dict": {k: v for k, v in skeleton["dict"].items() if k not in self.omit}}

    @staticmethod
    def _cut(
        result: save.Plan, host: int, leaf: int, bounds: Any, source: Any, outer: Any, dtype: Any
    ) -> None:
        for piece in save._chunk_grid([list(b) for b in bounds], outer):
            shape = tuple(b - a for a, b in piece)
            result.pieces.setdefault(host, []).append(save.Piece(leaf, piece, source, (), shape, dtype))

    def hand_over(self, host: int, writer: Any, step: int, attempt: str, pieces: list[save.Piece]) -> int:
        blocks, values = [], []
        for p in pieces:
            if p.source[0] == "block":
                blocks.append((p.leaf, p.bounds, p.source[1], [list(b) for b in p.source[2]]))
            else:
                local = tuple(slice(a, b) for a, b in p.bounds)
                data = np.asarray(self.values[p.source[1]])
                values.append((p.leaf, p.bounds, np.ascontiguousarray(data[local] if data.ndim else data)))
        try:
            keeper = self.snaps.keeper
            return int(keeper.write_to(self.step, self.record["attempt"], step, attempt, blocks, values))
        except Exception as e:
            raise CheckpointError(
                f"saving snapshot step {self.step} as step {step}: process {self.snaps.process}'s sidecar "
                f"could not hand its blocks to its writer: {type(e).__name__}: {e}"
            ) from e


def save_to(
    snaps: Any, manager: Any, step: int, metadata: dict[str, Any] | None, omit: tuple[str, ...] = ()
) -> bool:
    """Snapshot `step` saved through `manager` by every process's sidecar (a collective)."""
    error, held = "", None
    try:
        found = dict(snaps._survey())
        if step not in found:
            raise SnapshotError(
                f"snapshot step {step} is not complete on every host (complete: {sorted(found)})"
            )
        snaps.refill(step, found[step])
        holdings = snaps.keeper.holdings_by_source()[step]
        record = agree.complete(*holdings["own"])
        if record is None or "manifest" not in record:
            raise SnapshotError(
                f"snapshot step {step}: this process's sidecar lacks its shards or their layout"
            )
        if manager.cluster.hosts[0].address != snaps.host.address:
            raise SnapshotError("save_to needs the checkpoint manager on this process's own sidecar")
        held = MultiBlocks(snaps, step, record, omit)
    except Exception as e:  # noqa: BLE001 - every process hears of it below
        error = f"process {snaps.process}: {type(e).__name__}: {e}"
    failed = [s for s in snaps._exchange.allgather(error, f"save_to of step {step}") if s]
    if failed:
        raise SnapshotError(f"saving snapshot step {step} failed before storage was touched: {failed[0]}")
    assert held is not None
    return bool(manager.save_held(step, held, metadata=metadata))
