"""Finding recoverable snapshots and restoring them from the survivors' arenas (controller).

`survey` asks each live host's keeper what it holds (committed records and block keys); a
snapshot is recoverable when some live keeper has its record and every shard it lists is held
by a live host (its primary or a replica). A restore plans each target device's slice as the
checkpoint restore does (`checkpoint.restore`'s target checks, plan and assembly); each slice
is read from one live host holding all of it when there is one (preferring the device's own
host), else stitched here from the parts each holder cuts out.
"""

from __future__ import annotations

import pickle
from collections import defaultdict
from typing import Any

import jax
import numpy as np

from colocar.checkpoint import restore as ckpt_restore
from colocar.controller_bridge.arrays import aligned_empty
from colocar.errors import CheckpointError, SnapshotError
from colocar.shm import ArenaFullError

from ..policy.events import log
from .keepers.held import Key, key_of
from .keepers.stitch import Bounds
from .slices import check_covered, sources

Survey = dict[int, dict[int, dict[str, Any]]]  # host -> step -> {"record", "attempt", "state", "keys"}


def survey(keepers: dict[int, Any], hosts: list[int]) -> Survey:
    """What each of `hosts` holds; a host whose keeper does not answer holds nothing (logged:
    a restore that then finds no snapshot says which hosts did not answer and why)."""
    futures = {}
    found: Survey = {}
    for h in hosts:
        try:
            futures[h] = keepers[h].holdings.submit()
        except Exception as e:  # noqa: BLE001 - lost: it holds nothing
            _unanswered(h, e)
    for h, future in futures.items():
        try:
            found[h] = future.result()
        except Exception as e:  # noqa: BLE001
            _unanswered(h, e)
    return found


def _unanswered(host: int, error: BaseException) -> None:
    what = f"{type(error).__name__}: {error}"
    log.warning("snapshot survey: host %d's keeper did not answer (%s)", host, what)


def records(found: Survey) -> dict[int, list[dict[str, Any]]]:
    """step -> its committed records (one per attempt at the step), newest first."""
    out: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)
    for held in found.values():
        for step, info in held.items():
            if info["record"] is not None and info["attempt"] not in out[step]:
                out[step][info["attempt"]] = pickle.loads(info["record"])
    return {s: sorted(r.values(), key=lambda r: -r["time"]) for s, r in out.items()}


def holders(found: Survey, step: int, attempt: str) -> dict[Key, list[int]]:
    """Shard key -> the live hosts holding it in their snapshot of `step` made by `attempt`
    (a host that began another attempt at the step holds other data under the same keys)."""
    where: dict[Key, list[int]] = defaultdict(list)
    for h, held in found.items():
        info = held.get(step)
        if info is not None and info["attempt"] == attempt:
            for key in info["keys"]:
                where[key_of(*key)].append(h)
    return where


def missing(record: dict[str, Any], where: dict[Key, list[int]]) -> list[tuple[int, Key]]:
    """(primary host, shard) of each shard no live host holds."""
    return [
        (h, key_of(leaf, bounds))
        for h, shards in record["shards"].items()
        for leaf, bounds in shards
        if not where.get(key_of(leaf, bounds))
    ]


def usable(found: Survey, step: int) -> dict[str, Any] | None:
    """The newest committed record of `step` whose every shard a live host holds, or None."""
    for record in records(found).get(step, []):
        if not missing(record, holders(found, step, record["attempt"])):
            return record
    return None


def recoverable(found: Survey) -> list[int]:
    """Committed steps whose every shard a live host holds, ascending."""
    return sorted(s for s in records(found) if usable(found, s) is not None)


def restore(step: int, target: Any, cluster: Any, found: Survey, keepers: dict[int, Any]) -> Any:
    """The snapshot's tree on `target` (a pytree of ShapeDtypeStructs with shardings)."""
    record = usable(found, step)
    if record is None:
        unrecoverable(step, found)
    assert record is not None
    where = holders(found, step, record["attempt"])
    leaves, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=lambda x: x is None)
    targets = {jax.tree_util.keystr(path): leaf for path, leaf in leaves}
    values = pickle.loads(record["values"])
    out: dict[str, Any] = {}
    arrays = {}
    for key, wanted_leaf in targets.items():
        if key in values:
            out[key] = values[key]
        elif key in record["leaves"]:
            arrays[key] = wanted_leaf
        else:
            raise SnapshotError(f"{key}: not in snapshot step {step} (it holds {record['keys'][:20]})")
    try:
        _, wanted = ckpt_restore._split_targets(record["leaves"], arrays, cluster.devices, step)
    except CheckpointError as e:
        raise SnapshotError(f"snapshot {e}") from None
    requests, placed = ckpt_restore._plan(wanted, cluster, ckpt_restore.RestoreStats())
    results = _read(step, record["attempt"], requests, where, keepers, cluster)
    for picked in wanted:
        out[picked.key] = ckpt_restore._assemble(picked, cluster, placed, results)
    return jax.tree_util.tree_unflatten(treedef, [out[k] for k in targets])


def unrecoverable(step: int, found: Survey) -> None:
    """Raises SnapshotError saying why `step` cannot be restored from the live hosts."""
    committed = records(found)
    if step not in committed:
        raise SnapshotError(
            f"snapshot step {step} is not committed on any live host (live: {sorted(found)}; "
            f"committed there: {sorted(committed)})"
        )
    record = committed[step][0]
    lost = missing(record, holders(found, step, record["attempt"]))
    host, (leaf, bounds) = lost[0]
    raise SnapshotError(
        f"snapshot step {step} is not recoverable: {len(lost)} shards have no live copy, e.g. "
        f"leaf {leaf} {list(bounds)} of host {host} (its replicas were on hosts "
        f"{record['replicas'].get(host)}; live hosts: {sorted(found)}). Restore an older "
        "snapshot (latest()) or from storage"
    )


def _read(
    step: int,
    attempt: str,
    requests: dict[int, list[Any]],
    where: dict[Key, list[int]],
    keepers: dict[int, Any],
    cluster: Any,
) -> dict[int, list[np.ndarray]]:
    """Per device host, its requested slices (in request order) read from the holders."""
    plans: dict[int, list[list[tuple[int, Bounds, int]]]] = {}  # h -> per request: (source, part, i)
    reads: dict[int, list[tuple[int, str, list[list[int]]]]] = defaultdict(list)
    load: dict[int, int] = {}  # elements each source serves so far
    for h, wanted in requests.items():
        plans[h] = []
        for leaf, dtype, bounds in wanted:
            parts = []
            for source, part in sources(h, leaf, key_of(leaf, bounds)[1], where, load):
                parts.append((source, part, len(reads[source])))
                reads[source].append((leaf, dtype, [list(b) for b in part]))
            plans[h].append(parts)
    got = _fetch(step, attempt, reads, keepers)
    return {h: _assembled(step, wanted, plans[h], got, cluster.hosts[h]) for h, wanted in requests.items()}


def _assembled(
    step: int,
    wanted: list[Any],
    plans: list[list[tuple[int, Bounds, int]]],
    got: dict[int, list[np.ndarray]],
    host: Any,
) -> list[np.ndarray]:
    """One host's slices: as read when one holder sent it whole, else stitched from its parts."""
    whole = [
        len(p) == 1 and [list(b) for b in p[0][1]] == [list(b) for b in w[2]]
        for p, w in zip(plans, wanted, strict=True)
    ]
    specs = [(tuple(b - a for a, b in w[2]), w[1]) for w, one in zip(wanted, whole, strict=True) if not one]
    buffers = iter(_buffers(host, specs))
    out = []
    for (leaf, _, bounds), parts, one in zip(wanted, plans, whole, strict=True):
        if one:  # its bytes as they came (a region of the holder's block: no copy)
            out.append(got[parts[0][0]][parts[0][2]])
            continue
        check_covered(step, leaf, bounds, [p for _, p, _ in parts])
        stitched = next(buffers)
        for source, part, i in parts:
            stitched[tuple(slice(a - o[0], b - o[0]) for (a, b), o in zip(part, bounds, strict=True))] = got[
                source
            ][i]
        out.append(stitched)
    return out


def _buffers(host: Any, specs: list[tuple[tuple[int, ...], Any]]) -> list[np.ndarray]:
    """Arrays to stitch slices into: blocks of the host's arena where the controller maps it
    (pre-faulted memory, which `device_put` aliases on CPU; leased while the restored arrays
    live, as a checkpoint restore's), else (or when the arena has no room now) aligned memory."""
    if specs and host.connection.blocks.mapped:
        try:
            return list(host.connection.blocks.empty([(s, np.dtype(d)) for s, d in specs], timeout=0.0))
        except ArenaFullError:
            pass
    return [aligned_empty(shape, dtype) for shape, dtype in specs]


def _fetch(
    step: int, attempt: str, reads: dict[int, list[Any]], keepers: dict[int, Any]
) -> dict[int, list[np.ndarray]]:
    """Every source host cuts its parts at once; a failure gives up the others' reads."""
    futures = {}
    try:
        for source, wanted in reads.items():
            futures[source] = keepers[source].read.submit(step, attempt, wanted)
        return {source: list(future.result()) for source, future in futures.items()}
    except Exception as e:
        for future in futures.values():
            future.give_up()
        raise SnapshotError(f"reading snapshot step {step} from the surviving hosts failed: {e}") from e
