"""Snapshots under multi-controller JAX: one process per host, each on its own sidecar (controller).

Each process copies only its addressable shards (each distinct one once, replicated arrays
included, so that every process can restore its devices from its own host) into its own
sidecar's keeper (`keepers/multi.py`); that keeper replicates them to the next hosts' keepers in
ring order over the peer path and, once done, stores the record the process handed it (tree,
leaves, its shards, plain leaves pickled) there and with its replicas, whether or not that
process still lives (`commit_when_replicated`). A snapshot counts once every
process's record and shards are in place: the processes learn it from each other at the next
`take` (or `wait`, `latest`) through jax.distributed's key-value store (`agree.py` here).

Restarted trainers (new processes, same sidecars) make a `Snapshots` of the same `name`: the
keepers are detached and still hold the blocks; `latest()` agrees on the newest step complete
everywhere and `restore` refills a replaced (empty) sidecar from its peers' replicas
(`refill.py` here) before each process builds its devices' slices of the target, of the saved
sharding or another one (`restore.py` here). A job restarted with fewer processes reads the
shards of the processes it lacks from the replicas the others hold (`agree.absent`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax

from colocar.controller_bridge.obj import colocated_class
from colocar.errors import SnapshotError
from colocar.shm import ArenaFullError
from colocar.shm.allocator import footprint

from .. import take
from ..keepers.multi import MultiKeeper
from ..keepers.peers import PeerOptions, Target
from . import agree, refill, restore, save

_Keeper = colocated_class(MultiKeeper)
log = logging.getLogger("colocar.elastic")
KEEPER_TTL = 30 * 24 * 3600.0
ENDED = ("replicated", "failed")


class MultiSnapshots:
    """`Snapshots` for one JAX process per host (made by `Snapshots(...)` when
    `jax.process_count() > 1`). `cluster`: this process's own sidecar (`colocar.connect` with
    one address). `address`: that sidecar's address as the other hosts reach it (default:
    the one the cluster connected to). Every process takes, waits for, finds and restores the
    same snapshots in the same order."""

    def __init__(
        self,
        cluster: Any,
        *,
        replicas: int,
        keep: int,
        pool: str | None,
        name: str | None,
        peer_options: PeerOptions,
        address: str | None = None,
        replication_timeout: float = 600.0,
        idle_seconds: float = 7200.0,
        copy_threads: int = 4,
        sync_timeout: float = 300.0,
        placement: take.Placement = take.ring,
    ):
        if len(cluster.hosts) != 1:
            raise SnapshotError(
                "with several JAX processes, each one snapshots into its own host's sidecar "
                f"(colocar.connect() with one address); this cluster has {len(cluster.hosts)} hosts"
            )
        self.process, self.processes = jax.process_index(), jax.process_count()
        if not 0 <= replicas < self.processes:
            raise ValueError(f"replicas must be between 0 and {self.processes - 1}, got {replicas}")
        self.cluster, self.host = cluster, cluster.hosts[0]
        self.replicas, self.keep, self.pool = replicas, keep, pool or "default"
        self.timeout = replication_timeout
        setup = agree.Exchange("colocar/snapshots", sync_timeout)
        self.name = name or setup.leader_value(uuid.uuid4().hex, "name")
        self._exchange = agree.Exchange(f"colocar/snapshots/{self.name}", sync_timeout)
        mine = own_address(address, self.host.address)
        self._addresses = addresses = self._exchange.allgather(mine, "addresses")
        self.incarnation = self._exchange.leader_value(uuid.uuid4().hex, "incarnation")
        self.targets = _placed(self._exchange, placement, self.processes, replicas)
        self._peers = [Target(t, addresses[t], self._keeper_name(t)) for t in self.targets[self.process]]
        self._copiers = ThreadPoolExecutor(copy_threads, thread_name_prefix="colocar-snap-copy")
        self._lock = threading.RLock()
        self._takes = 0
        self._pending: tuple[int, threading.Thread, list[bool]] | None = None  # step, committer, ok
        self._stats: dict[str, Any] = {"taken": 0, "skipped": 0, "last_take": {}, "refilled_bytes": 0}
        self._stats["fetched_bytes"] = 0  # read from the peers' keepers by restores onto other layouts
        self._closed = False
        self.keeper = self._open_keeper(peer_options, idle_seconds)
        self._committed = [s for s, _ in self._survey()][-keep:]

    def _keeper_name(self, process: int) -> str:
        return f"colocar.snapshots/{self.name}/{process}"

    def _open_keeper(self, peer_options: PeerOptions, idle_seconds: float) -> Any:
        """The keeper an earlier trainer of this name left on this sidecar, or a new one."""
        name = self._keeper_name(self.process)
        try:
            return self.host.object(name)
        except Exception:  # noqa: BLE001 - none there yet (a new or replaced sidecar)
            pass
        make = _Keeper.on(self.host, name=name, ttl=KEEPER_TTL)
        return make(self.process, self.pool, peer_options, idle_seconds)

    # --- taking -------------------------------------------------------------------------------
    def take(self, step: int, tree: Any) -> bool:
        """This process's shards -> its sidecar's keeper, which replicates them to its peers in
        the background; False (every process) when one process's pool lacks room."""
        if self._closed:
            raise SnapshotError("this Snapshots is closed")
        started = time.monotonic()
        with self._lock:
            prev_ok = self._finish_pending()
            attempt = f"{self.incarnation}/{self._takes}"
            self._takes += 1
            pieces, record = refill.plan(
                step, attempt, tree, self.process, self.targets[self.process], self.cluster
            )
            need = sum(footprint(p.nbytes) for p in pieces) * (1 + self.replicas)
            reason = self._misfit(step, need)
            said = self._exchange.allgather(json.dumps([prev_ok, reason]), f"take of step {step}")
            self._settle([json.loads(s)[0] for s in said])
            reasons = [(q, json.loads(s)[1]) for q, s in enumerate(said) if json.loads(s)[1]]
            if reasons:
                self._stats["skipped"] += 1
                return take.skip(f"process {reasons[0][0]}: {reasons[0][1]}")
            keep = [s for s in self._committed if s != step][-(self.keep - 1) :] if self.keep > 1 else []
            self.keeper.begin(step, attempt, keep, [tuple(t) for t in self._peers])
            try:
                take.send(self.host, self.keeper, step, attempt, pieces, self.pool, self._copiers)
            except ArenaFullError as e:
                self.keeper.drop(step)
                raise SnapshotError(f"snapshot of step {step}: this process's pool filled up: {e}") from e
            self._start_commit(step, attempt, record)
            self._stats["taken"] += 1
            self._stats["last_take"] = {
                "step": step,
                "bytes": need // (1 + self.replicas),
                "blocked_seconds": time.monotonic() - started,
            }
            return True

    def _misfit(self, step: int, need: int) -> str | None:
        pools = self.host.stats()["pools"]
        if self.pool not in pools:
            return f"host has no arena pool {self.pool!r} (it has {sorted(pools)})"
        free = pools[self.pool]["reserved"] - pools[self.pool]["used"]
        if need > free:
            return (
                f"snapshot of step {step} skipped: it needs {need} bytes in arena pool {self.pool!r} "
                f"(its shards and the replicas it receives) but {free} are free; training goes on"
            )
        return None

    def _start_commit(self, step: int, attempt: str, record: bytes) -> None:
        ok = [False]

        def run() -> None:
            deadline = time.monotonic() + self.timeout
            try:  # the keeper commits and shares the record itself once replicated
                self.keeper.commit_when_replicated(step, attempt, record)
                while (status := self.keeper.status(step, attempt, 1.0))["state"] not in ENDED:
                    if status["state"] == "unknown" or time.monotonic() > deadline:
                        break
                if status["state"] == "replicated":
                    ok[0] = True
                else:
                    log.warning("snapshot of step %d is abandoned: %s", step, status.get("error") or status)
            except Exception as e:  # noqa: BLE001 - a background thread: the snapshot never counts
                log.warning("snapshot of step %d is abandoned: %s: %s", step, type(e).__name__, e)

        thread = threading.Thread(target=run, name=f"colocar-snap-commit-{step}", daemon=True)
        thread.start()
        self._pending = (step, thread, ok)

    def _finish_pending(self) -> bool | None:
        """Waits for this process's part of the last take; whether it committed (None: no take)."""
        if self._pending is None:
            return None
        _, thread, ok = self._pending
        thread.join()
        return ok[0]

    def _settle(self, oks: list[bool | None]) -> None:
        """The last take counts when every process committed its part; else it is dropped."""
        if self._pending is None:
            return
        step = self._pending[0]
        self._pending = None
        if all(oks):
            self._committed = sorted({*self._committed, step})[-self.keep :]
            return
        failed = [q for q, ok in enumerate(oks) if not ok]
        log.warning("snapshot of step %d does not count: processes %s did not complete it", step, failed)
        try:
            self.keeper.drop(step)
        except Exception:  # noqa: BLE001
            pass

    def wait(self, timeout: float | None = None) -> None:
        """Until every process's part of the last take ended (a collective: every process calls it)."""
        with self._lock:
            ok = self._finish_pending()
            said = self._exchange.allgather(json.dumps(ok), "wait")
            self._settle([json.loads(s) for s in said])

    # --- finding and restoring ----------------------------------------------------------------
    def _survey(self) -> list[tuple[int, str]]:
        """The steps complete everywhere, from every keeper's holdings; a keeper that cannot be
        read (here or in another process) leaves none, in every process alike."""
        try:
            summary = agree.summarize(self.keeper.holdings_by_source())
        except Exception as e:  # noqa: BLE001 - every process hears of it in the exchange
            summary = agree.unreadable(self.process, e)
        self._summaries = agree.gather(self._exchange, summary)
        if errors := agree.errors(self._summaries):
            log.warning("no snapshot counts: a keeper could not be read (%s)", errors[0])
        return agree.agreed(self._summaries)

    def latest(self, hosts: Any = None) -> int | None:
        """Newest snapshot complete everywhere (every process's shards on its own sidecar or a
        peer's); a collective."""
        self.wait()
        found = self._survey()
        return found[-1][0] if found else None

    def restore(self, step: int, target: Any, hosts: Any = None) -> Any:
        """Snapshot `step` onto `target` (any sharding of the saved shapes), each process its
        addressable devices' slices, after refilling sidecars that lost their shards from the
        peers' replicas: read from its own sidecar, parts held by the other processes' sidecars
        fetched into it keeper to keeper (`restore.py` here); a collective."""
        with self._lock:
            found = dict(self._survey())
            if step not in found:
                unread = "".join(f"; {e}" for e in agree.errors(self._summaries))
                raise SnapshotError(
                    f"snapshot step {step} is not complete on every host (complete: {sorted(found)}{unread})"
                )
            attempt = found[step]
            self.refill(step, attempt)
            out = restore.restore(self, step, attempt, target)
            self._committed = sorted({*self._committed, step})[-self.keep :]
            return out

    def refill(self, step: int, attempt: str) -> None:
        """Brings back the shards and records of `step` that replaced (empty) sidecars lost,
        from the peers' replicas (`refill.py` here); a collective, before a restore or save."""
        self._stats["refilled_bytes"] += refill.refill(self, step, attempt)

    def save_to(
        self, manager: Any, step: int, *, metadata: dict[str, Any] | None = None, omit: tuple[str, ...] = ()
    ) -> bool:
        """Snapshot `step` written to storage through `manager` (a multi-controller
        CheckpointManager on this process's sidecar) from the blocks in the sidecars: each
        distinct shard by the one process holding its replica 0, as `manager.save` writes it;
        a collective. The result is a normal committed step (`save.py` here) without the
        top-level keys in `omit`. Raises SnapshotError on every process alike, before storage
        is touched, when the snapshot is not complete everywhere."""
        with self._lock:
            self.wait()
            return save.save_to(self, manager, step, metadata, omit)

    def agree(self, value: str, what: str) -> list[str]:
        """Every process's `value` in process order (a collective), for deciding something
        together, e.g. whether a save comes from a snapshot (`what` names it in errors)."""
        with self._lock:
            return self._exchange.allgather(value, what)

    def stats(self) -> dict[str, Any]:
        return {**self._stats, "committed": list(self._committed), "process": self.process}

    def close(self) -> None:
        """Waits for this process's last replication, then deletes its keeper (freeing its
        blocks). A trainer that dies without `close` leaves them to its restarted successor."""
        if self._closed:
            return
        self._closed = True
        try:
            self._finish_pending()
        finally:
            try:
                self.keeper.close()
                self.keeper.delete()
            except Exception:  # noqa: BLE001 - a lost sidecar took its keeper with it
                pass
            self._copiers.shutdown(wait=False)

    def __enter__(self) -> MultiSnapshots:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _placed(exchange: Any, placement: take.Placement, processes: int, replicas: int) -> dict[int, Any]:
    """Each process's replica peers from `placement`, checked to be the same on every process."""
    hosts = list(range(processes))
    targets = take.placement_of(placement, hosts, replicas) if replicas else {}
    targets = {p: targets.get(p, []) for p in hosts}
    said = exchange.allgather(json.dumps(targets), "placement")
    if len(set(said)) != 1:
        raise SnapshotError(f"the processes place replicas differently (give all the same placement): {said}")
    return targets


def own_address(address: str | None, connected: str) -> str:
    """This host's sidecar as the other hosts reach it: `address`, else $COLOCAR_PEER_ADDRESS
    (`{hostname}` in it becomes this machine's host name; `colocar k8s render` sets it to the
    pod's DNS name), else the address this process connected to."""
    if address:
        return address
    env = os.environ.get("COLOCAR_PEER_ADDRESS")
    return env.format(hostname=socket.gethostname()) if env else connected


def make(
    cluster: Any,
    token_of: Any,
    *,
    replicas: int = 1,
    keep: int = 2,
    pool: str | None = None,
    placement: Any = None,
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
) -> MultiSnapshots:
    """`Snapshots(...)`'s options for a multi-controller job: hosts are the JAX processes (by
    process index), and every process, restarted ones too, must be given the same `placement`."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    options = PeerOptions(
        token=token if token is not None else token_of(cluster),
        tls_ca=tls_ca,
        tls_cert=tls_cert,
        tls_key=tls_key,
        heartbeat_seconds=cluster.hosts[0].connection.session.heartbeat_seconds,
        bandwidth=bandwidth,
    )
    return MultiSnapshots(
        cluster,
        replicas=replicas,
        keep=keep,
        pool=pool,
        name=name,
        peer_options=options,
        address=address,
        replication_timeout=replication_timeout,
        placement=placement or take.ring,
        idle_seconds=idle_seconds,
        copy_threads=copy_threads,
    )
