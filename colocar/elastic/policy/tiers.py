"""The two places a state can come back from: snapshots in host memory, checkpoints in storage.

Runs in the controller. Both tiers are reopened over the surviving hosts after a loss (the old
object is closed, quietly: it still talks to the lost host). `StorageTier` wraps a
`CheckpointManager` (or a factory of one per cluster); the elastic bookkeeping (the step to
resume at, the data position in records) rides in the checkpoint's metadata. `SnapshotTier`
wraps `colocar.elastic.snapshots.Snapshots` when that module exists and keeps the bookkeeping
in this process (snapshots live as long as this controller anyway).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

from colocar.controller_bridge.cluster import Cluster

log = logging.getLogger("colocar.elastic")

META_KEY = "elastic"


def _close_quietly(thing: Any, what: str) -> None:
    """Closes an object built over hosts of which one is lost; what it raises is only logged."""
    try:
        thing.close()
    except Exception as e:
        log.info("closing the %s over the old hosts: %s: %s", what, type(e).__name__, e)


def _reopen_checkpoints(old: Any, cluster: Cluster) -> Any:
    """A `CheckpointManager` like `old` (same directory and options) over `cluster`."""
    from colocar.checkpoint import CheckpointManager

    o = old.options
    return CheckpointManager(
        old.directory,
        cluster,
        max_to_keep=o.max_to_keep,
        keep_period=o.keep_period,
        save_interval_steps=old.save_interval_steps,
        queue=old.queue,
        pool=old.pool,
        concurrent_writes=o.concurrent_writes,
        writer_nice=o.nice,
        heartbeat_seconds=o.heartbeat_seconds,
        stale_seconds=o.stale_seconds,
        commit_timeout=o.commit_timeout,
        storage_timeout=old.storage_timeout,
        lease_seconds=old._lease.seconds,
    )


class StorageTier:
    """Committed checkpoints in storage, through a `CheckpointManager` over the live hosts."""

    def __init__(self, checkpoints: Any):
        from colocar.checkpoint import CheckpointManager

        if isinstance(checkpoints, CheckpointManager):
            self.manager: Any = checkpoints
            self._factory: Callable[[Cluster], Any] | None = None
        elif callable(checkpoints):
            self.manager, self._factory = None, checkpoints
        else:
            raise TypeError(
                "checkpoints= takes a CheckpointManager or a function cluster -> CheckpointManager, "
                f"got {type(checkpoints).__name__}"
            )
        self.source = ""  # where the last save came from: "snapshot" or "devices"
        self.saved_from = {"snapshot": 0, "devices": 0}

    def open(self, cluster: Cluster) -> None:
        """Makes sure the manager drives exactly `cluster`'s hosts."""
        old = self.manager
        if old is not None and old.cluster is cluster:
            return
        if old is not None:
            _close_quietly(old, "checkpoint manager")
        if self._factory is not None:
            self.manager = self._factory(cluster)
        else:
            self.manager = _reopen_checkpoints(old, cluster)

    def latest(self) -> int | None:
        return self.manager.latest_step() if self.manager is not None else None

    def save(self, step: int, tree: Any, meta: dict[str, Any], snap: SnapshotTier | None = None) -> bool:
        """Starts the save of `tree` as `step` (written in the background): from the blocks of a
        snapshot just taken of these very arrays when there is one (no second copy from the
        devices: `snap.save_taken`, under multi-controller; `snap_save` in a single controller),
        else from the devices. `source` then says which."""
        from ..snapshots.save import save_if_taken

        metadata = {META_KEY: meta}
        saved = snap.save_taken(self.manager, step, tree, metadata) if snap is not None else None
        if saved is None:
            saved = save_if_taken(self.manager, step, tree, metadata)
        self.source = "devices" if saved is None else "snapshot"
        if saved is None:
            saved = self.manager.save(step, tree, metadata=metadata, force=True)
        self.saved_from[self.source] += 1
        return bool(saved)

    def stats(self) -> dict[str, Any]:
        """The checkpoint manager's stats, and how many saves came from snapshots or devices."""
        return {**self.manager.stats(), "saved_from": dict(self.saved_from)}

    def meta(self, step: int) -> dict[str, Any]:
        """The elastic bookkeeping saved with `step` ({} for a step saved otherwise)."""
        return dict(self.manager.metadata(step).get(META_KEY, {}))

    def restore(self, step: int, target: Any) -> Any:
        """`step`'s tree onto `target` (resharded)."""
        return self.manager.restore(step, target=target)

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()


def _single(target: Any, meta: dict[str, Any]) -> str | None:
    """The name the one saved value was saved under, when `target` is that value alone."""
    from .survivors import ElasticError

    keys = meta.get("keys") or []
    if isinstance(target, dict) and set(target) == set(keys):
        return None
    if len(keys) != 1:
        raise ElasticError(
            f"the saved state has parts {keys}: pass restore(target=...) a dict with those keys"
        )
    return str(keys[0])


def wrap(target: Any, meta: dict[str, Any]) -> Any:
    """`restore`'s target as the tree `step` saved: a dict of the state's parts."""
    key = _single(target, meta)
    return target if key is None else {key: target}


def unwrap(target: Any, tree: Any, meta: dict[str, Any]) -> Any:
    """The restored tree in the shape of `restore`'s target."""
    key = _single(target, meta)
    return tree if key is None else tree[key]


def snapshots_available() -> bool:
    """Whether `colocar.elastic.snapshots` is installed (it arrives separately)."""
    try:
        importlib.import_module("colocar.elastic.snapshots")
    except ImportError:
        return False
    return True


class SnapshotTier:
    """Host-memory snapshots (`colocar.elastic.snapshots.Snapshots`) over the live hosts."""

    def __init__(self, snapshots: Any, replicas: int):
        self._given = snapshots  # an instance, a factory cluster -> Snapshots, or True (build one)
        self.replicas = replicas
        self.snapshots: Any = None if snapshots is True or callable(snapshots) else snapshots
        self.cluster: Cluster | None = getattr(self.snapshots, "cluster", None)  # what it spans
        self.meta: dict[int, dict[str, Any]] = {}
        self._reported: tuple[int, int] | None = None  # the replication last made an event

    def _build(self, cluster: Cluster) -> Any:
        if callable(self._given) and self._given is not True:
            return self._given(cluster)
        module = importlib.import_module("colocar.elastic.snapshots")
        return module.Snapshots(cluster, replicas=self.replicas)

    def open(self, cluster: Cluster) -> None:
        """A `Snapshots` over `cluster` (after `restore` read what it needed from the old one)."""
        old = self.snapshots
        if old is not None and self.cluster is cluster:
            return
        if old is not None:
            _close_quietly(old, "snapshots")
        self.snapshots, self.cluster = self._build(cluster), cluster

    def take(self, step: int, tree: Any, meta: dict[str, Any]) -> bool:
        taken = bool(self.snapshots.take(step, tree))
        if taken:
            self.meta[step] = meta
            # the snapshots the keepers may still hold (`keep`), and the one in flight
            for old in sorted(self.meta)[: -(getattr(self.snapshots, "keep", 2) + 1)]:
                del self.meta[old]
        return taken

    def latest(self, hosts: list[Any] | None) -> int | None:
        if self.snapshots is None:
            return None
        step = self.snapshots.latest(hosts)
        return step if step in self.meta else None

    def meta_of(self, step: int) -> dict[str, Any]:
        """The bookkeeping (keys, data position) of snapshot `step`, as `take` got it."""
        return self.meta[step]

    def restore(self, step: int, target: Any, hosts: list[Any] | None) -> Any:
        return self.snapshots.restore(step, target, hosts)

    def recover(self, step: int, target: Any, agree: Callable[[str, str], str]) -> tuple[Any, Any] | str:
        """(`restore`'s target filled from snapshot `step`, its bookkeeping), or why it is not
        recoverable: a `SnapshotError` reading its bookkeeping or its arrays, here or, through
        `agree` (every process's error, the first one that failed: a collective under
        multi-controller JAX), in another process, so that every process falls back alike."""
        from colocar.errors import SnapshotError

        found, error = None, ""
        try:
            meta = self.meta_of(step)
            found = unwrap(target, self.restore(step, wrap(target, meta), None), meta), meta
        except SnapshotError as e:
            error = f"{type(e).__name__}: {e}"
        error = agree(error, f"restore of snapshot step {step}")
        return error if error or found is None else found

    def fallback(self, snap_step: int | None, disk_step: int | None) -> tuple[int, str] | None:
        """When the newest snapshot taken is newer than what a restore will use (`snap_step`,
        else `disk_step`, else nothing): (its step, why it is unusable and what is used instead),
        e.g. a shard and all its replicas were on lost hosts, or it was in flight at the loss."""
        if self.snapshots is None or not self.meta:
            return None
        newest = max(self.meta)
        if snap_step is not None and snap_step >= newest or disk_step is not None and disk_step >= newest:
            return None
        why = self.snapshots.unusable(newest) or f"snapshot step {newest} is not recoverable"
        if snap_step is not None and (disk_step is None or snap_step >= disk_step):
            instead = f"the older snapshot of step {snap_step}"
        else:
            instead = f"storage step {disk_step}" if disk_step is not None else "init()"
        return newest, f"{why}; restoring from {instead}"

    def save_taken(self, manager: Any, step: int, tree: Any, metadata: dict[str, Any]) -> bool | None:
        """Saves `step` through `manager` from the snapshot just taken of `tree`; None: not
        this tier's to do (a single controller's saves find their snapshot in `snapshots.save`)."""
        return None

    def wait(self) -> None:
        if self.snapshots is not None:
            self.snapshots.wait()

    def report_replication(self, events: Any) -> None:
        """Adds a "replication" event for the last take once its replication ended (committed
        or failed), once: its step, seconds, and bytes sent to the peers."""
        done = (self.stats() or {}).get("replication")
        if not done or done["state"] == "replicating":
            return
        key = (id(self.snapshots), done["step"])
        if key == self._reported:
            return
        self._reported = key
        hosts = [h.name for h in self.cluster.hosts] if self.cluster is not None else []
        detail = f"{done['state']}, {done['bytes']} bytes to peers" + (
            f": {done['error']}" if done["error"] else ""
        )
        events.add("replication", done["step"], float(done["seconds"] or 0.0), hosts, detail[:300])

    def stats(self) -> dict[str, Any]:
        return self.snapshots.stats() if self.snapshots is not None else {}

    def close(self, keep: bool = False) -> None:
        """Closes the snapshots (`keep`: only the multi-controller tier keeps them)."""
        if self.snapshots is not None:
            _close_quietly(self.snapshots, "snapshots")
