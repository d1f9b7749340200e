"""Multi-controller JAX (`jax.distributed`, one process per host, each on its own sidecar).

`MultiController`: the run function gets every process's devices; a jax.distributed job cannot
shrink, so a loss ends this trainer with an `ElasticError` (it is restarted in place and resumes
from the sidecars' RAM); the processes agree on what `restore` reads through jax.distributed's
key-value store (a snapshot that fails to restore in one process sends all of them to storage:
`first_error`), and the snapshots carry their own bookkeeping (`MultiSnapshotTier`), since a
restarted trainer has none of its predecessor's. A storage save of a step just snapshotted is
written by the sidecars from that snapshot's blocks (`MultiSnapshotTier.save_taken`), a choice
every process makes alike. Runs in the controller (each trainer process).
"""

from __future__ import annotations

import json
from typing import Any

from colocar.controller_bridge.cluster import Cluster, Host

from ..policy.events import Events, log
from ..policy.survivors import ElasticError, looks_like_loss, lost_hosts
from ..policy.tiers import SnapshotTier

META_LEAF = "__colocar_elastic__"  # the snapshot's leaf holding the bookkeeping (JSON)
DEFAULT_NAME = "colocar-elastic"  # multi-controller snapshots' name: restarted trainers find them


class MultiController:
    """One JAX process per host, each on its own sidecar: nothing shrinks in-process."""

    multi, rejoins = True, False

    def __init__(self, sync_timeout: float = 300.0):
        import jax

        from ..snapshots.multi.agree import Exchange

        self.process, self.processes = jax.process_index(), jax.process_count()
        self._exchange = Exchange("colocar/elastic", sync_timeout)

    def devices(self, cluster: Cluster) -> list[Any]:
        import jax

        return list(jax.devices())  # every process's: the mesh spans the job

    def live(self, root: Cluster, alive: list[Host]) -> int:
        """Every process's host while this one's sidecar is alive (the job never shrinks)."""
        return self.processes if len(alive) == len(root.hosts) else 0

    def snapshot_tier(self, given: Any, replicas: int, cluster: Cluster, name: str | None) -> SnapshotTier:
        return MultiSnapshotTier(given, replicas, cluster, name or DEFAULT_NAME)

    def lost(
        self, cluster: Cluster, error: BaseException, timeout: float | None, events: Events
    ) -> list[Host]:
        """Never recovers in-process: an error that looks like a loss (this host's sidecar, or
        another process that stopped answering) becomes an `ElasticError`; others propagate."""
        if not looks_like_loss(error):
            return []
        hosts = [h.name for h in lost_hosts(cluster)]
        detail = f"{type(error).__name__}: {error}"
        events.add("loss", None, hosts=hosts, detail=detail[:500])
        raise ElasticError(
            f"JAX process {self.process} of {self.processes}: a host or process is lost ({detail[:300]}). "
            "A multi-controller job cannot go on with fewer processes: this trainer must exit and be "
            "restarted (e.g. `colocar k8s render --trainer-restarts N`); the restarted trainers resume "
            "from the newest snapshot in the sidecars' RAM, else from storage"
        ) from error

    def agreed(self, value: int | None, what: str) -> int | None:
        """Process 0's `value`: every process then restores the same step (a collective)."""
        said = self._exchange.leader_value(json.dumps(value), what)
        out = json.loads(said)
        return None if out is None else int(out)

    def first_error(self, error: str, what: str) -> str:
        """The first process's error of what every process just tried ("": none failed), the
        same in every process (a collective): they go on alike, e.g. all from storage."""
        failed = [f"process {q}: {e}" for q, e in enumerate(self._exchange.allgather(error, what)) if e]
        return failed[0] if failed else ""


class MultiSnapshotTier(SnapshotTier):
    """`MultiSnapshots` (`snapshots/multi/store.py`) of a stable name over this process's sidecar, whose
    snapshots carry the manager's bookkeeping as a plain leaf: a restarted trainer reads it back
    with the state. Opened on first use (`latest` or `take`); every call is a collective."""

    def __init__(self, snapshots: Any, replicas: int, cluster: Cluster, name: str):
        super().__init__(snapshots, replicas)
        self.root, self.name = cluster, name
        self._taken: tuple[int, list[Any]] | None = None  # the last take's step and arrays

    def _build(self, cluster: Cluster) -> Any:
        if callable(self._given) and self._given is not True:
            return self._given(cluster)
        from ..snapshots import Snapshots

        return Snapshots(cluster, replicas=self.replicas, name=self.name)

    def take(self, step: int, tree: Any, meta: dict[str, Any]) -> bool:
        from ..snapshots.save import leaves, remember

        taken = super().take(step, {**tree, META_LEAF: json.dumps(meta)}, meta)
        self._taken = (step, remember(leaves(tree))) if taken else None  # every process took it, or none
        return taken

    def save_taken(self, manager: Any, step: int, tree: Any, metadata: dict[str, Any]) -> bool | None:
        """Saves `step` from the blocks of the snapshot just taken of these very arrays when it
        completed everywhere, without the bookkeeping leaf (the metadata carries it, as in a
        save from the devices); None, on every process alike (a collective): save from the
        devices. Whether a take of `step` counted is known to all; that it was of these arrays
        each process checks, and they agree."""
        from colocar.errors import SnapshotError

        from ..snapshots.save import same

        taken, self._taken = self._taken, None
        if taken is None or taken[0] != step or self.snapshots is None:
            return None
        said = self.snapshots.agree(json.dumps(same(taken[1], tree)), f"saving step {step} from its snapshot")
        if not all(json.loads(s) for s in said):
            return None
        try:
            return bool(self.snapshots.save_to(manager, step, metadata=metadata, omit=(META_LEAF,)))
        except SnapshotError as e:  # raised on every process before storage was touched
            log.warning("saving step %d from its snapshot: %s; saving from the devices", step, e)
            return None

    def latest(self, hosts: list[Any] | None) -> int | None:
        if self.snapshots is None:
            self.open(self.root)
        step = self.snapshots.latest(hosts)
        return None if step is None else int(step)

    def meta_of(self, step: int) -> dict[str, Any]:
        if step not in self.meta:
            self.meta[step] = json.loads(self.snapshots.restore(step, {META_LEAF: None})[META_LEAF])
        return self.meta[step]

    def restore(self, step: int, target: Any, hosts: list[Any] | None) -> Any:
        tree = dict(self.snapshots.restore(step, {**target, META_LEAF: None}))
        tree.pop(META_LEAF)
        return tree

    def close(self, keep: bool = False) -> None:
        """Deletes this process's keeper and its blocks; `keep`: leaves them (and the replicas
        it holds for its peers) to the restarted trainer, as a trainer that dies does."""
        if keep:
            self.snapshots = None
            return
        super().close()

    def fallback(self, snap_step: int | None, disk_step: int | None) -> tuple[int, str] | None:
        return None  # the processes agree on the newest complete snapshot; none is skipped


__all__ = ["DEFAULT_NAME", "META_LEAF", "MultiController", "MultiSnapshotTier"]
