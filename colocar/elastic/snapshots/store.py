"""`Snapshots`: host-memory snapshots in the sidecars' arenas, with peer replicas (controller).

`take` copies every distinct shard device -> its host's arena (as a checkpoint save does) and
hands the blocks to the host's keeper (`keepers/keeper.py`, a detached object); it returns once the
copies are done. Each keeper then copies its blocks to `replicas` peer hosts' keepers, sidecar
to sidecar (`keepers/peers.py`), in the background; a snapshot counts once every shard and its
replicas are in place and its record is committed in the keepers (`commit.py`), so losing
any `replicas` hosts loses no shard. `keep` snapshots hold blocks at most: a new one starts
after dropping all but the newest `keep - 1` complete ones. `latest` and `restore` ask the
surviving keepers (`restore.py`).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax

from colocar.controller_bridge.obj import colocated_class
from colocar.errors import SnapshotError
from colocar.protocol.tokens import TOKEN_METADATA_KEY

from . import handoff, restore, save, take
from .commit import POLL_SECONDS, Committer
from .keepers.keeper import SnapshotKeeper
from .keepers.peers import PeerOptions
from .multi import store as multi_store

_Keeper = colocated_class(SnapshotKeeper)
log = logging.getLogger("colocar.elastic")
KEEPER_TTL = 30 * 24 * 3600.0  # the object's; its blocks go after `idle_seconds` without a controller


def _token(cluster: Any) -> str:
    """The token the controller reached the sidecars with (the peers accept the same): the
    one its gRPC calls carry."""
    return str(dict(cluster.hosts[0].connection.grpc.metadata).get(TOKEN_METADATA_KEY, ""))


def _check_args(hosts: int, replicas: int, keep: int) -> None:
    if not 0 <= replicas < hosts:
        raise ValueError(f"replicas must be between 0 and {hosts - 1} for {hosts} hosts, got {replicas}")
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")


class Snapshots:
    """Host-memory snapshots of a pytree of jax.Arrays in the sidecars' arenas, with peer replicas.

    `replicas`: peer hosts holding a copy of each host's shards (default placement: the next
    hosts in ring order; `placement(hosts, replicas) -> {host: [peers]}` to choose). `pool`:
    the arena pool holding the blocks. `name`: the keepers' name; a new `Snapshots` with the
    name of an earlier one (a restarted controller) finds its committed snapshots. `bandwidth`
    caps each host's replication rate (bytes/s). `token` and `tls_*` (PEM paths on the hosts)
    authenticate the sidecars to each other (default: the controller's token).

    Under multi-controller JAX (`jax.process_count() > 1`) this makes a `MultiSnapshots`
    (`multi/store.py`): each process snapshots its own shards into its own sidecar (`cluster`:
    `colocar.connect` with that one address; `address`: it as the other hosts reach it).
    """

    def __new__(cls, cluster: Any, **options: Any) -> Any:
        if jax.process_count() > 1:
            return multi_store.make(cluster, _token, **options)
        return super().__new__(cls)

    def __init__(
        self,
        cluster: Any,
        *,
        replicas: int = 1,
        keep: int = 2,
        pool: str | None = None,
        placement: take.Placement | None = None,
        name: str | None = None,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        bandwidth: float = 0.0,
        replication_timeout: float = 600.0,
        idle_seconds: float = 2 * 3600.0,
        copy_threads: int = 4,
        address: str | None = None,
    ):
        hosts = [h.index for h in cluster.hosts]
        _check_args(len(hosts), replicas, keep)
        self.cluster = cluster
        self.replicas = replicas
        self.keep = keep
        self.pool = pool or "default"
        self.placement = placement or take.ring
        self.name = name or uuid.uuid4().hex
        heartbeat = cluster.hosts[0].connection.session.heartbeat_seconds
        self._peer_options = PeerOptions(
            token=token if token is not None else _token(cluster),
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
            heartbeat_seconds=heartbeat,
            bandwidth=bandwidth,
        )
        self._idle_seconds = idle_seconds
        self._lock = threading.RLock()
        self._committed_lock = threading.Lock()
        self._senders = ThreadPoolExecutor(len(hosts), thread_name_prefix="colocar-snap-send")
        self._copiers = ThreadPoolExecutor(copy_threads, thread_name_prefix="colocar-snap-copy")
        self._keepers: dict[int, Any] = {}
        self._committer = Committer(self._keeper, self._committed_now, replication_timeout)
        self._committed: list[int] = []
        self._records: dict[int, dict[str, Any]] = {}  # of this object's recent takes (`save_to`)
        self._taken: tuple[int, list[Any]] | None = None  # the last take's step and arrays
        self._stats: dict[str, Any] = {"taken": 0, "skipped": 0, "last_take": {}}
        self._closed = False
        self._generations: dict[int, int] = {}  # of each host's sidecar when its keeper was opened
        self._capacity: dict[int, dict[str, int]] = {}  # each host's pool size, nothing used
        self._layouts: dict[Any, Any] = {}  # `take.plan`'s cache
        self._spares = handoff.Spares()  # the next take's blocks
        self._open(hosts)
        self._committed = restore.recoverable(restore.survey(self._keepers, hosts))
        save._OPEN.add(self)

    def _open(self, hosts: list[int]) -> None:
        """Checks the pool exists everywhere (noting its size) and opens every host's keeper."""
        try:
            pools = self._pools(hosts)
            self._capacity = {h: {"reserved": p["reserved"], "used": 0} for h, p in pools.items()}
            for f in [self._senders.submit(self._open_keeper, h) for h in self.cluster.hosts]:
                f.result()
        except BaseException:
            self.close()
            raise

    def _keeper_name(self, h: int) -> str:
        return f"colocar.snapshots/{self.name}/{h}"

    def _open_keeper(self, host: Any) -> None:
        """The host's keeper: the one an earlier `Snapshots` of this name left, or a new one."""
        name = self._keeper_name(host.index)
        self._generations[host.index] = host.connection.session.generation
        try:
            self._keepers[host.index] = host.object(name)
            return
        except Exception:  # noqa: BLE001 - none there yet
            pass
        self._keepers[host.index] = _Keeper.on(host, name=name, ttl=KEEPER_TTL)(
            host.index, self.pool, self._peer_options, self._idle_seconds
        )

    def _keeper(self, h: int) -> Any:
        return self._keepers[h]

    def _reopen_restarted(self, hosts: list[int]) -> None:
        """A host whose sidecar restarted since (it lost its keeper and blocks) gets a new keeper."""
        for h in hosts:
            host = self.cluster.hosts[h]
            if host.connection.session.generation != self._generations.get(h):
                self._open_keeper(host)

    def _committed_now(self, step: int) -> None:
        with self._committed_lock:  # not self._lock: take() holds that while it waits for a commit
            self._committed = sorted({*self._committed, step})[-self.keep :]

    # --- taking -------------------------------------------------------------------------------
    def take(self, step: int, tree: Any) -> bool:
        """Copies every distinct shard device -> its host's arena and returns; the keepers get
        the blocks, replicate and commit them in the background (`commit.py`). It first waits
        for the previous snapshot to commit (or fail), so that the newest committed one is at
        most one take old when a host is lost; when a pool has no room for one more snapshot,
        it also drops what is not kept before copying. False, with a `SnapshotSkipped` warning
        naming the sizes, when it does not fit."""
        if self._closed:
            raise SnapshotError("this Snapshots is closed")
        started = time.monotonic()
        with self._lock:
            self._committer.wait(None)  # the previous one counts first: a loss costs one interval at most
            hosts, replicas = self._hosts_now()
            self._reopen_restarted(hosts)
            planned = take.plan(step, tree, self.cluster, hosts, replicas, self.placement, self._layouts)
            try:
                reason = take.misfit(planned, self._capacity, self.pool)  # can never fit
                placed = handoff.place(self, planned) if reason is None and self._trusted() else None
                if placed is not None:
                    hand_off = functools.partial(handoff.hand_off, self, planned, placed)
                    then = self._spares.after(self, planned)
                    self._committer.track(step, hosts, planned.record, hand_off, then)
                elif reason is None:
                    reason = handoff.take_waiting(self, planned)
            except BaseException:  # a host lost (or an interrupt): no part of this step stays
                self._drop(step, hosts)
                raise
            if reason is not None:
                self._drop(step, hosts)
                self._stats["skipped"] += 1
                return take.skip(reason)
            keep = self._kept(step)
            self._records = {s: r for s, r in self._records.items() if s in keep} | {step: planned.record}
            self._taken = (step, save.remember(planned.leaves))
            self._stats["taken"] += 1
            self._stats["last_take"] = {
                "step": step,
                "bytes": sum(planned.own.values()),
                "blocked_seconds": time.monotonic() - started,
            }
            return True

    def _trusted(self) -> bool:
        """Whether a take may copy before the previous snapshot ended: once one went through
        and the last one did not fail (a failed one, e.g. a full pool, makes the next take
        wait and check the fit first)."""
        last = self._committer.last
        return last is not None and last.state != "failed"

    def _kept(self, step: int) -> list[int]:
        """The committed snapshots a new one at `step` keeps (the newest `keep - 1`)."""
        with self._committed_lock:
            committed = [s for s in self._committed if s != step]
        return committed[-(self.keep - 1) :] if self.keep > 1 else []

    def save_to(self, manager: Any, step: int, *, metadata: dict[str, Any] | None = None) -> bool:
        """Writes snapshot `step` to storage through `manager` (a `CheckpointManager` over these
        hosts) from the blocks the hosts hold: no device-to-host copy (`save.py`). Returns
        once the writers have them; `manager.wait()` for the commit."""
        if self._closed:
            raise SnapshotError("this Snapshots is closed")
        with self._lock:  # no take drops the step's blocks before the writers hold them
            self._committer.wait_handed(step)
            return save.save_to(self, manager, step, metadata)

    def _hosts_now(self) -> tuple[list[int], int]:
        """The hosts not lost, and the replicas a snapshot can have among them."""
        hosts = self._live(None)
        replicas = min(self.replicas, len(hosts) - 1)
        if replicas < self.replicas:
            log.warning(
                "snapshots keep %d replicas instead of %d: only hosts %s are left",
                replicas,
                self.replicas,
                hosts,
            )
        return hosts, replicas

    def _pools(self, hosts: list[int]) -> dict[int, dict[str, int]]:
        futures = {h: self._senders.submit(self.cluster.hosts[h].stats) for h in hosts}
        pools = {}
        for h, future in futures.items():
            found = future.result()["pools"]
            if self.pool not in found:
                raise SnapshotError(f"host {h} has no arena pool {self.pool!r} (it has {sorted(found)})")
            pools[h] = found[self.pool]
        return pools

    def _drop(self, step: int, hosts: list[int]) -> None:
        for h in hosts:
            try:
                self._keepers[h].drop(step)
            except Exception:  # noqa: BLE001 - a lost host holds nothing
                pass

    def wait(self, timeout: float | None = None) -> None:
        """Until the replication (and commit) of the last take ended; TimeoutError after `timeout`."""
        self._committer.wait(timeout)

    # --- finding and restoring ----------------------------------------------------------------
    def _settle(self) -> None:
        """Waits for the snapshot in flight to end (a loss ends its wait within a poll round)."""
        try:
            self._committer.wait(self._committer.timeout + 2 * POLL_SECONDS)
        except TimeoutError:
            pass  # the older ones answer; the late one counts once it commits

    def _live(self, hosts: Any) -> list[int]:
        """Indices in this cluster of `hosts` (indices, or `Host`s of this cluster or of a view
        of it that renumbered them: matched by their connection); None: the hosts not lost."""
        if hosts is None:
            return [h.index for h in self.cluster.hosts if h.connection.session.lost is None]
        mine = {id(h.connection): h.index for h in self.cluster.hosts}
        out = []
        for h in hosts:
            if isinstance(h, int):
                out.append(h)
            elif id(h.connection) in mine:
                out.append(mine[id(h.connection)])
            else:
                raise SnapshotError(f"{h} is not a host of the snapshots' cluster {self.cluster}")
        return out

    def latest(self, hosts: Any = None) -> int | None:
        """Newest committed snapshot recoverable from `hosts` (default: the hosts not lost),
        once the one in flight ended (committed, salvaged after a loss, or abandoned)."""
        self._settle()
        steps = restore.recoverable(restore.survey(self._keepers, self._live(hosts)))
        return steps[-1] if steps else None

    def unusable(self, step: int, hosts: Any = None) -> str | None:
        """Why `step` cannot be restored from `hosts` (default: the hosts not lost), or None."""
        self._settle()
        found = restore.survey(self._keepers, self._live(hosts))
        if restore.usable(found, step) is not None:
            return None
        try:
            restore.unrecoverable(step, found)
        except SnapshotError as e:
            return str(e)
        return None

    def restore(self, step: int, target: Any, hosts: Any = None) -> Any:
        """The snapshot's tree onto `target` (ShapeDtypeStructs with shardings, e.g. on a smaller
        mesh), each shard read from a surviving host holding it. SnapshotError if not recoverable."""
        found = restore.survey(self._keepers, self._live(hosts))
        return restore.restore(step, target, self.cluster, found, self._keepers)

    def stats(self) -> dict[str, Any]:
        last = self._committer.last
        replication = None
        if last is not None:
            replication = {
                "step": last.step,
                "state": last.state,
                "error": last.error,
                "seconds": last.seconds,
                "bytes": sum(s.get("replicated_bytes", 0) for s in last.statuses.values()),
            }
        return {
            **self._stats,
            "committed": list(self._committed),
            "replication": replication,
            "spare_bytes": self._spares.sizes(),
        }

    def close(self) -> None:
        """Waits for the last replication, then deletes the keepers (freeing every block)."""
        if self._closed:
            return
        self._closed = True
        self._taken = None
        try:
            self._committer.wait(None)
        finally:
            self._committer.close()
            self._spares.clear(self.cluster)
            for handle in self._keepers.values():
                try:
                    handle.close()
                    handle.delete()
                except Exception:  # noqa: BLE001 - a lost (or restarted) host took its keeper with it
                    pass
            self._keepers = {}
            self._senders.shutdown(wait=False)
            self._copiers.shutdown(wait=False)

    def __enter__(self) -> Snapshots:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
