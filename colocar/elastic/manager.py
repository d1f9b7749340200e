"""`Manager`: training that survives the loss of hosts, in a single controller.

Runs in the controller. The user's run function gets the live hosts and their devices; when a
host is lost (its sidecar died or stopped answering) the error that surfaced (in `next(it)`, a
save, a colocated call) is caught, the lost host's loaders are closed, and the run function is
called again with the survivors, over a `ClusterView` of them. There `restore` brings back the
newest state it can find (a host-memory snapshot complete on the survivors, else the newest
committed storage checkpoint, else `init()`), resharded onto the new mesh, together with the
data position in records, so the loader continues the record stream exactly. Errors that do
not come from a lost host are never caught. When lost hosts come back, `step` hands the state
over at the step boundary and the run function is called again with all hosts (`policy/rejoin.py`).

Step numbers: `step(s, ...)` is called once step `s` of the loop is done, so what it saves is
the state after `s + 1` steps and is stored as step `s + 1`; `restore` returns that number,
the step the loop continues at (0 after `init`).

Under multi-controller JAX (one process per host, each on its own sidecar) the same code runs
in every process (`topologies/`): the run function gets every process's devices, snapshots
and saves are collectives, and `restore` is agreed by all. A loss is not recovered in-process
(a jax.distributed job cannot shrink): it raises `ElasticError` and the trainer, restarted in
place, resumes from the snapshot in the sidecars' RAM. Scaling up is single-controller only.
"""

from __future__ import annotations

import functools
import time
import traceback
from collections.abc import Callable
from typing import Any

from colocar.controller_bridge.cluster import Cluster
from colocar.errors import HostLostError

from .faults import Fault, Schedule
from .policy import data
from .policy.events import Events, log
from .policy.rejoin import Handoff, Rescale, fresh_session, reshard, returned_hosts
from .policy.survivors import ClusterView, ElasticError, alive_hosts, lost_hosts
from .policy.tiers import StorageTier, snapshots_available, unwrap, wrap
from .topologies import controllers_of


class Manager:
    """Elastic training over `cluster`: snapshots, saves, recovery onto fewer hosts.

    `checkpoints`: a `CheckpointManager` over `cluster` (reopened over the survivors after a
    loss, with the same directory and options) or a function `cluster -> CheckpointManager`.
    `save_every`: save every that many steps (default: the checkpoint manager's
    `save_interval_steps`). `snapshot_every`, `replicas`, `snapshots`: the host-memory tier
    (`colocar.elastic.snapshots`), used when that module is present; `snapshots=False` turns
    it off. `faults`: faults to fire from `step` (see `colocar.elastic.faults`).
    `loss_timeout`: how long an error that looks like a loss waits for a host to be marked
    lost (default: from the hosts' heartbeat, `policy.survivors.loss_grace`).

    Multi-controller JAX (`jax.process_count() > 1`, `cluster`: this process's own sidecar):
    every process runs the same loop; a lost host or process raises `ElasticError` out of the
    run function (it is not called again): restart the trainers in place and they resume from
    the newest snapshot complete in every sidecar's RAM, else the newest committed checkpoint.
    `snapshot_name`: the snapshots' name there (default "colocar-elastic"), which the restarted
    trainers look for; one job per set of sidecars.
    """

    def __init__(
        self,
        cluster: Cluster,
        checkpoints: Any = None,
        *,
        snapshot_every: int | None = 10,
        save_every: int | None = None,
        replicas: int = 1,
        snapshots: Any = None,
        faults: list[Fault] | tuple[Fault, ...] = (),
        loss_timeout: float | None = None,
        snapshot_name: str | None = None,
    ):
        self.controllers = controllers_of()  # one controller, or one JAX process per host
        self.root = cluster
        self.cluster = cluster  # the hosts of the current attempt (the root, or a view)
        self.storage = StorageTier(checkpoints) if checkpoints is not None else None
        self.snapshot_every = snapshot_every
        self.save_every = save_every
        if snapshots is None:
            snapshots = bool(snapshot_every) and snapshots_available()
        tier = self.controllers.snapshot_tier
        self.snap = tier(snapshots, replicas, cluster, snapshot_name) if snapshots else None
        self.faults = Schedule(faults)
        self.loss_timeout = loss_timeout
        self.events = Events()
        self.attempt = 0
        self.data_states: dict[str, dict[str, Any]] = {}
        self.restored_step: int | None = None
        self.restored_from: str | None = None
        self._keys: list[str] = []  # the names of the state's parts, as `step` got them
        self._iterators: list[Any] = []  # loaders of this attempt, closed after a loss
        self._lost_at: float | None = None
        self._last_step: int | None = None
        self._snap_current = self.snap is not None and self.snap.snapshots is not None
        self._handoff: Handoff | None = None  # the state at the boundary of a scale-up
        self._closed = False

    # --- the run loop -----------------------------------------------------------------------
    def run(self, min_hosts: int = 1) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorates `fn(hosts, devices, *args)`: calling the result runs it, and runs it again
        with the surviving hosts after each loss, until it returns. Raises `ElasticError` when
        fewer than `min_hosts` hosts are left; any error not caused by a lost host propagates."""
        if min_hosts < 1:
            raise ValueError(f"min_hosts must be at least 1, got {min_hosts}")

        def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(fn)
            def elastic_run(*args: Any, **kwargs: Any) -> Any:
                return self._run(fn, min_hosts, args, kwargs)

            return elastic_run

        return decorate

    def _run(
        self, fn: Callable[..., Any], min_hosts: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        while True:
            try:
                self._begin_attempt(min_hosts)
                devices = self.controllers.devices(self.cluster)
                return fn(list(self.cluster.hosts), devices, *args, **kwargs)
            except Rescale:
                self._close_loaders("of the attempt before the scale-up")
                self._snap_current = False  # the next snapshots span every host
            except ElasticError:
                raise
            except BaseException as error:
                # only hosts of this attempt count: all of them were alive when it began
                lost = self.controllers.lost(self.cluster, error, self.loss_timeout, self.events)
                if not lost:
                    raise
                self._after_loss([h.name for h in lost], error)
                traceback.clear_frames(error.__traceback__)  # the failed attempt's batches go now
            finally:
                self._iterators = []

    def _begin_attempt(self, min_hosts: int) -> None:
        """The live hosts become this attempt's cluster; the storage tier moves onto them."""
        if self._closed:
            raise ElasticError("this elastic Manager is closed")
        alive = alive_hosts(self.root)
        if self.controllers.live(self.root, alive) < min_hosts:
            raise ElasticError(
                f"only {len(alive)} of {len(self.root.hosts)} hosts are left "
                f"({[h.name for h in alive]}; lost: {[h.name for h in lost_hosts(self.root)]}), fewer than "
                f"min_hosts={min_hosts}: bring hosts back, or lower min_hosts"
            )
        if len(alive) == len(self.root.hosts):
            cluster: Cluster = self.root
        else:
            cluster = ClusterView(self.root, alive)
        if isinstance(self.cluster, ClusterView) and self.cluster is not cluster:
            self.cluster.close()
        self.cluster = cluster
        if self.storage is not None:
            self.storage.open(cluster)
        self.attempt += 1

    def _after_loss(self, lost: list[str], error: BaseException) -> None:
        """Records the loss and closes the failed attempt's loaders (the lost host's part is
        freed by its session's end; the survivors' workers and slots go now)."""
        self._lost_at = time.monotonic()
        detail = f"{type(error).__name__}: {error}"
        self.events.add("loss", self._last_step, hosts=lost, detail=detail[:500])
        self._handoff = None  # its arrays may be on the lost host's devices
        self._close_loaders("of the failed attempt")
        if self.snap is not None:
            self._snap_current = False  # restore reads the old snapshots, then they move

    def _close_loaders(self, which: str) -> None:
        """Closes the attempt's loaders: their workers and ring slots are freed now."""
        for iterator in self._iterators:
            try:
                iterator.close()
            except Exception as e:  # a lost host's part cannot answer
                log.info("closing a loader %s: %s: %s", which, type(e).__name__, e)
        self._iterators = []

    # --- restoring ----------------------------------------------------------------------------
    def restore(self, target: Any, init: Callable[[], Any] | None = None) -> tuple[Any, int]:
        """(state, step to continue at): the newest snapshot recoverable from the live hosts,
        else the newest committed checkpoint, else `init()` and step 0.

        `target` has the structure of what `step` saves (without the data iterators): the one
        value when `step` got one besides its iterators, else a dict of them; leaves are
        `jax.ShapeDtypeStruct`s with shardings (or arrays) on the current mesh. The data
        position comes back in `data_state` / `data_start`."""
        started = time.monotonic()
        handoff, self._handoff = self._handoff, None
        meta: dict[str, Any]
        if handoff is not None:  # a scale-up: the state of the boundary, onto the new mesh
            tree = reshard(handoff.tree, wrap(target, handoff.meta))
            found: Any = unwrap(target, tree, handoff.meta), handoff.step, "scale_up", handoff.meta
        else:
            found = self._restore_newest(target)
        if found is None:
            if init is None:
                raise ElasticError("nothing to restore (no snapshot, no checkpoint) and no init= given")
            state, step, source, meta = init(), 0, "init", {}
        else:
            state, step, source, meta = found
        self.data_states = dict(meta.get("data", {}))
        self.restored_step, self.restored_from = step, source
        self._move_snapshots()
        seconds = time.monotonic() - started
        hosts = [h.name for h in self.cluster.hosts]
        self.events.add("restore", step, seconds, hosts, f"from {source}")
        if self._lost_at is not None:
            self.events.add("recovery", step, time.monotonic() - self._lost_at, hosts, f"from {source}")
            self._lost_at = None
        if handoff is not None:
            self._refill(step, tree, handoff.meta)
            detail = f"{','.join(handoff.hosts)} back; the state of step {step} moved onto {len(hosts)} hosts"
            self.events.add("scale_up", step, time.monotonic() - handoff.noticed, hosts, detail)
        return state, step

    def _restore_newest(self, target: Any) -> tuple[Any, int, str, dict[str, Any]] | None:
        snap_step = self.snap.latest(None) if self.snap is not None else None
        disk_step = self.storage.latest() if self.storage is not None else None
        disk_step = self.controllers.agreed(disk_step, "the newest checkpoint to restore")
        if self.snap is not None and (fell := self.snap.fallback(snap_step, disk_step)):
            self.events.add("fallback", fell[0], 0.0, [], fell[1][:500])
        if snap_step is not None and (disk_step is None or snap_step >= disk_step):
            assert self.snap is not None  # not recoverable in one process: storage in all
            found = self.snap.recover(snap_step, target, self.controllers.first_error)
            if not isinstance(found, str):
                return found[0], snap_step, "snapshot", found[1]
            self.events.add("restore", snap_step, 0.0, [], f"snapshot unusable: {found}"[:300])
        if disk_step is None:
            return None
        assert self.storage is not None
        meta = self.storage.meta(disk_step)
        tree = self.storage.restore(disk_step, wrap(target, meta))
        return unwrap(target, tree, meta), disk_step, "storage", meta

    def _move_snapshots(self) -> None:
        """After a loss, the snapshot tier moves onto the survivors once restore read from it."""
        if self.snap is not None and not self._snap_current:
            self.snap.open(self.cluster)
            self._snap_current = True

    # --- the data position --------------------------------------------------------------------
    @property
    def data_state(self) -> dict[str, Any] | None:
        """The restored position of the data iterator named "data" (or of the only one):
        records consumed, global batch size and the loader's own state; None at the start."""
        if "data" in self.data_states or len(self.data_states) != 1:
            return self.data_states.get("data")
        return next(iter(self.data_states.values()))

    def data_start(self, config: Any, name: str = "data") -> int:
        """The batch number at which a loader of `config` resumes the restored position."""
        from colocar.loaders.config import load_config

        saved = self.data_states.get(name)
        if saved is None and self.restored_from not in (None, "init"):
            raise ElasticError(
                f"step {self.restored_step} (from {self.restored_from}) holds no position for data "
                f"{name!r}: pass the iterator to step() under that name"
            )
        return data.start_batch(saved, load_config(config), name)

    def load(self, config: Any, mesh: Any = None, *, name: str = "data", **options: Any) -> Any:
        """`colocar.loaders.load` over the current hosts, resuming the restored position of
        data `name`; closed by the manager if a host is lost."""
        from colocar import loaders
        from colocar.loaders.config import load_config

        cfg = load_config(config)
        iterator = loaders.load(cfg, self.cluster, mesh, start=self.data_start(cfg, name), **options)
        self._iterators.append(iterator)
        return iterator

    # --- each step ----------------------------------------------------------------------------
    def step(self, step: int, items: dict[str, Any]) -> None:
        """Step `step` is done: takes a snapshot and starts a save when due (as step
        `step + 1`), fires the faults due, and raises `HostLostError` if a host is lost, or
        `Rescale` (caught by `run`) if lost hosts came back.

        `items`: names to pytrees of arrays (the state) or data iterators (their position in
        records is kept with the state)."""
        self._last_step = step
        lost = lost_hosts(self.cluster)
        if lost:
            raise HostLostError(str(lost[0].connection.session.lost))
        done = step + 1
        iterators = {k: v for k, v in items.items() if data.is_data_iterator(v)}
        tree = {k: v for k, v in items.items() if k not in iterators}
        for iterator in iterators.values():
            if not any(iterator is seen for seen in self._iterators):
                self._iterators.append(iterator)
        meta = {
            "step": done,
            "keys": sorted(tree),
            "data": {k: data.position(it) for k, it in iterators.items()},
        }
        self._keys = sorted(tree)
        self._snapshot_if_due(done, tree, meta)
        self._save_if_due(done, tree, meta)
        for fault in self.faults.fire_due(self.cluster, step):
            self.events.add("fault", step, hosts=[fault.host_name], detail=fault.action)
        if self.snap is not None and self.snap.snapshots is not None:
            self.snap.report_replication(self.events)
        self._rejoin_if_back(done, tree, meta)

    def _rejoin_if_back(self, done: int, tree: dict[str, Any], meta: dict[str, Any]) -> None:
        """Lost hosts came back: keeps this boundary's state and ends the attempt (`Rescale`)."""
        if self._closed or self._lost_at is not None or not self.controllers.rejoins:
            return
        back = [h.name for h in returned_hosts(self.root, self.cluster) if fresh_session(h)]
        if back:
            self._handoff = Handoff(done, tree, meta, back)
            raise Rescale(back, done)

    def _refill(self, step: int, tree: dict[str, Any], meta: dict[str, Any]) -> None:
        """A snapshot over all hosts at once after a scale-up: the newcomers' shards and the
        replicas they hold are made anew from the state just moved (their arenas start empty)."""
        if self.snap is None or not self.snapshot_every:
            return
        started = time.monotonic()
        taken = self.snap.take(step, tree, meta)
        hosts = [h.name for h in self.cluster.hosts]
        detail = "refill after the scale-up" if taken else "refill after the scale-up did not fit"
        self.events.add("snapshot", step, time.monotonic() - started, hosts, detail)

    def _snapshot_if_due(self, done: int, tree: dict[str, Any], meta: dict[str, Any]) -> None:
        if self.snap is None or not self.snapshot_every or done % self.snapshot_every:
            return
        self._move_snapshots()
        started = time.monotonic()
        taken = self.snap.take(done, tree, meta)
        hosts = [h.name for h in self.cluster.hosts]
        self.events.add("snapshot", done, time.monotonic() - started, hosts, "" if taken else "did not fit")

    def _save_if_due(self, done: int, tree: dict[str, Any], meta: dict[str, Any]) -> None:
        if self.storage is None:
            return
        due = done % self.save_every == 0 if self.save_every else self.storage.manager.should_save(done)
        if not due:
            return
        started = time.monotonic()
        self.storage.save(done, tree, meta, self.snap)
        hosts = [h.name for h in self.cluster.hosts]
        detail = f"started from the {self.storage.source} (commit in the background)"
        self.events.add("save", done, time.monotonic() - started, hosts, detail)

    # --- stats, close -------------------------------------------------------------------------
    @property
    def checkpoints(self) -> Any:
        """The `CheckpointManager` over the current hosts (a new one after a loss)."""
        return self.storage.manager if self.storage is not None else None

    def stats(self) -> dict[str, Any]:
        """Events with their timings (snapshot, save, restore, fault, loss, recovery, scale_up), their
        counts and total seconds per kind, and where the manager stands."""
        out = self.events.stats()
        out.update(
            attempt=self.attempt,
            hosts=[h.name for h in self.cluster.hosts],
            lost=[h.name for h in lost_hosts(self.root)],  # now; the events keep the history
            restored_step=self.restored_step,
            restored_from=self.restored_from,
        )
        if self.snap is not None:
            out["snapshots"] = self.snap.stats()
        if self.storage is not None and self.storage.manager is not None:
            out["checkpoints"] = self.storage.stats()  # and how many saves came from snapshots
        return out

    def close(self, keep_snapshots: bool = False) -> None:
        """Waits for the last save, closes the tiers and the view (never the user's cluster).
        `keep_snapshots` (multi-controller; the default when a `with` block ends in an error
        there): leaves the snapshots in the sidecars for the restarted trainers."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.storage is not None:
                self.storage.close()
        finally:
            if self.snap is not None:
                self.snap.close(keep_snapshots)
            if isinstance(self.cluster, ClusterView):
                self.cluster.close()

    def __enter__(self) -> Manager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(keep_snapshots=exc[0] is not None and self.controllers.multi)
