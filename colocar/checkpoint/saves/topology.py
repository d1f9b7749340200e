"""Who does what in a save: one controller driving every host, or multi-controller JAX (runs in
the controller).

With one controller, this process drives every host of its cluster: hosts are named in storage
by their cluster index, the cluster's first host commits, and chunk sizes follow the smallest
arena pool. With several JAX processes (`jax.distributed`), each process drives only its own
host's sidecar and names it by `jax.process_index()`; process 0 (the *leader*) holds the lease,
clears what a failed save left, hands every process the save's attempt id through JAX's
key-value store, writes the numpy leaves, and its sidecar commits; chunks have a fixed size, as
every process must cut the same ones. `topology_of` picks the one that applies; the manager
asks it instead of testing which case it is in.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import jax

from colocar.controller_bridge.cluster import Cluster, Host
from colocar.errors import CheckpointError

from ..format import layout
from .plan import Piece

NOT_STARTED = "not started: "  # what process 0 publishes instead of an attempt id when it failed


class Topology:
    """A single controller: this process drives every host of `cluster`."""

    leader = True  # takes the lease, clears failed saves, names the attempt, saves numpy leaves
    sole_client = True  # the only process of its job on its sidecars (see `fencing`)

    def __init__(self, cluster: Cluster, pool: str):
        self.cluster = cluster
        self.pool = pool
        self._pools: dict[int, int] = {}  # host -> bytes of the pool saves allocate from

    @property
    def primary(self) -> int:
        """The host (as named in storage) whose writer commits."""
        return self.cluster.hosts[0].index

    def storage_id(self, cluster_index: int) -> int:
        """How a host of this process's cluster is named in storage."""
        return cluster_index

    def host(self, storage_id: int) -> Host:
        return next(h for h in self.cluster.hosts if h.index == storage_id)

    def save_hosts(self, own: list[int]) -> list[int]:
        """Every host that writes part of a save whose hosts here are `own`."""
        return sorted(own)

    def chunk_bytes(self) -> int:
        """The outer chunk size when none was given: a quarter of the smallest arena pool."""
        sizes = [self.pool_bytes(h.index) for h in self.cluster.hosts]
        smallest = min([s for s in sizes if s] or [layout.MAX_OUTER_CHUNK_BYTES * 4])
        return max(1 << 20, min(layout.MAX_OUTER_CHUNK_BYTES, smallest // 4))

    def attempt(self, step: int, prepare: Callable[[], None], key: str, timeout: float) -> str:
        """A new id for this save of `step`, the same in every process; `prepare()` (removing
        what a failed save of the step left) runs first, in the leader only."""
        prepare()
        return uuid.uuid4().hex

    def refuse(self, key: str, error: BaseException) -> None:
        """The leader could not start the save named `key`: the other processes hear of it."""

    # --- arena pools ----------------------------------------------------------------------------
    def pool_bytes(self, storage_id: int) -> int:
        """The size of the arena pool saves use on a host (0 when shared memory is unreachable);
        asked once per host (arena sizes do not change)."""
        if storage_id not in self._pools:
            host = self.host(storage_id)
            pools = host.stats()["pools"] if host.shm else {}
            self._pools[storage_id] = pools.get(self.pool or "default", {}).get("reserved", 0)
        return self._pools[storage_id]

    def check_fits(self, pieces: dict[int, list[Piece]]) -> None:
        """Raises when a piece is larger than its host's whole pool (it could never be placed)."""
        for h, items in pieces.items():
            largest = max((p.nbytes for p in items), default=0)
            size = self.pool_bytes(h)
            if size and largest > size:
                raise CheckpointError(
                    f"a {largest}-byte chunk cannot fit arena pool {self.pool or 'default'!r} of host {h} "
                    f"({size} bytes): pass a smaller max_chunk_bytes or give the sidecar a larger arena"
                )


class MultiController(Topology):
    """One JAX process per host, each connected to its own sidecar only."""

    def __init__(self, cluster: Cluster, pool: str, kv: Callable[[], Any]):
        super().__init__(cluster, pool)
        if len(cluster.hosts) != 1:
            raise CheckpointError(
                "with several JAX processes, each one connects to its own host's sidecar only "
                f"(colocar.connect() with one address); this cluster has {len(cluster.hosts)} hosts"
            )
        self.process, self.processes = jax.process_index(), jax.process_count()
        self.sole_client = False  # processes of a job may share a host's sidecar
        self.leader = self.process == 0
        self._kv = kv  # JAX's distributed key-value store, asked for when first needed

    @property
    def primary(self) -> int:
        return 0

    def storage_id(self, cluster_index: int) -> int:
        return self.process

    def host(self, storage_id: int) -> Host:
        return self.cluster.hosts[0]

    def save_hosts(self, own: list[int]) -> list[int]:
        return list(range(self.processes))

    def chunk_bytes(self) -> int:
        return layout.MULTI_PROCESS_CHUNK_BYTES  # no local arena size: every process cuts the same

    def attempt(self, step: int, prepare: Callable[[], None], key: str, timeout: float) -> str:
        """The leader prepares, then publishes the id; the others wait for it (at most
        `timeout` s), so they write nothing before the leader's removal of a failed save."""
        if self.leader:
            prepare()
            attempt = uuid.uuid4().hex
            self._publish(key, attempt)
            return attempt
        try:
            attempt = str(self._kv().blocking_key_value_get(key, int(timeout * 1000)))
        except Exception as e:
            raise CheckpointError(
                f"process 0 did not start its save of step {step} within commit_timeout "
                f"({timeout:.0f} s): {e}"
            ) from e
        if attempt.startswith(NOT_STARTED):
            raise CheckpointError(
                f"process 0 could not start the save of step {step}: {attempt.removeprefix(NOT_STARTED)}"
            )
        return attempt

    def refuse(self, key: str, error: BaseException) -> None:
        if self.leader:
            self._publish(key, f"{NOT_STARTED}{type(error).__name__}: {error}")

    def _publish(self, key: str, value: str) -> None:
        try:
            self._kv().key_value_set(key, value)
        except Exception:
            pass  # published already (a failure after the id went out): the markers tell the rest


def topology_of(cluster: Cluster, pool: str, kv: Callable[[], Any]) -> Topology:
    """The topology of this process: multi-controller when JAX runs several processes."""
    if jax.process_count() > 1:
        return MultiController(cluster, pool, kv)
    return Topology(cluster, pool)
