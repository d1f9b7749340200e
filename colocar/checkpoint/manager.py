"""`CheckpointManager`: async saves written by the sidecars, restores with resharding.

Runs in the controller. `save` blocks only while shards are copied device -> arena and handed
to each host's writer (a long-lived detached object in its sidecar, see `writers` and
`backends/writer.py`); the writers store them with tensorstore, host 0's commits the step once
every host's part is durable. `wait` long-polls the writers and returns when the step is
committed, or raises what went wrong. Who does what (one controller, or one JAX process per
host) is the `topology`'s; the step directories are `steps.StepDirs`'. One manager writes a
directory at a time (a lease object it refreshes); any number may read it.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import signal
import threading
import time
import uuid
import warnings
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import jax

from colocar.controller_bridge.cluster import Cluster, current_cluster
from colocar.errors import CheckpointError, ColocarError

from .backends.writer import WriterOptions
from .format import layout, tree
from .orbax import files as orbax_files
from .orbax import names as orbax_names
from .orbax import shardings
from .restore import RestoreStats, restore_tree
from .saves import from_blocks
from .saves import plan as save
from .saves.inflight import InFlight, Save, SaveStats, save_failed
from .saves.plan import Piece
from .saves.topology import topology_of
from .saves.writers import Writers
from .store.catalog import Catalog, steps_of
from .store.lease import WriterLease
from .store.steps import STALE_SECONDS
from .store.storage import StorageError, open_storage

_ORDINALS: dict[str, Any] = defaultdict(itertools.count)


def _default_copy_threads() -> int:
    """Threads copying shards into the arenas: memory bandwidth stops scaling at a few."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cores))


class CheckpointManager:
    """Saves and restores pytrees of `jax.Array`s (and plain values) under `directory`.

    `directory`: `gs://bucket/prefix`, `file:///path` or a local path. `max_to_keep` committed
    steps are kept (plus every `keep_period`-th); `queue=True` lets one save start while the
    previous one is still being written (else `save` waits for it). `save_on_preemption`
    records SIGTERM so that the loop can `save` a last step (see `reached_preemption`).
    `layout`: "colocar" (its own format: `step_<N>/`) or "orbax" (what orbax-checkpoint's
    `CheckpointManager` writes: `<N>/<item>/`, "default", or "state" for v1's
    `training.Checkpointer`); restores and listings read both, and Orbax's own checkpoints
    (docs/coming-from.md, "Coming from Orbax").
    """

    def __init__(
        self,
        directory: str,
        cluster: Cluster | None = None,
        *,
        max_to_keep: int | None = None,
        keep_period: int | None = None,
        save_interval_steps: int = 1,
        queue: bool = False,
        pool: str = "",
        concurrent_writes: int = 2,
        writer_nice: int = 5,
        copy_threads: int | None = None,
        max_chunk_bytes: int | None = None,
        heartbeat_seconds: float = 5.0,
        stale_seconds: float = STALE_SECONDS,
        commit_timeout: float = 600.0,
        storage_timeout: float = 30.0,
        lease_seconds: float = 60.0,
        save_on_preemption: bool = False,
        layout: str = "colocar",
        item: str = orbax_names.ITEM,
    ):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be at least 1 (or None to keep all), got {max_to_keep}")
        self.layout, self.item = layout, orbax_names.check_item(item, layout)
        self.directory = directory
        self.storage = open_storage(directory, storage_timeout)
        self.steps = steps_of(self.storage, layout, item)  # what this manager writes
        self.catalog = Catalog(self.storage)  # what it reads: both layouts
        self.cluster = cluster if cluster is not None else current_cluster()
        self.save_interval_steps, self.queue, self.pool = save_interval_steps, queue, pool
        self.max_chunk_bytes, self.storage_timeout = max_chunk_bytes, storage_timeout
        self._id = uuid.uuid4().hex
        self.options = WriterOptions(
            concurrent_writes=concurrent_writes,
            nice=writer_nice,
            heartbeat_seconds=heartbeat_seconds,
            stale_seconds=stale_seconds,
            commit_timeout=commit_timeout,
            max_to_keep=max_to_keep,
            keep_period=keep_period,
            storage_timeout=storage_timeout,
            owner=self._id, layout=layout, item=item,
        )
        self._saves = 0  # save() calls past the interval check; names a save in every process
        self._ordinal = next(_ORDINALS[directory])  # managers of this directory made before, here
        self.topology = topology_of(self.cluster, pool, self._kv)
        self._start_workers(copy_threads, commit_timeout)
        self._last = SaveStats()
        self._restore_stats = RestoreStats()
        self._lock = threading.RLock()
        self._lease = WriterLease(self.storage, self._id, lease_seconds, self.cluster.hosts)
        if self.topology.leader:
            self._warn_of_holder()
        self._fenced = 0  # saves of earlier lease holders that taking the lease stopped
        self._preempted, self._closed = False, False
        self._previous_handler: Any = None
        if save_on_preemption:
            self._install_preemption_handler()

    def _start_workers(self, copy_threads: int | None, commit_timeout: float) -> None:
        """The threads that talk to the hosts (one per host) and copy shards into the arenas,
        the hosts' writers, and the tracker of saves in flight."""
        self._senders = ThreadPoolExecutor(len(self.cluster.hosts), thread_name_prefix="colocar-ckpt-send")
        self._writers = Writers(self.topology, self.storage.url, self.options, self._id, self._senders)
        self._writers.import_storage()
        self._inflight = InFlight(self.topology, self.steps, self._writers, self._senders, commit_timeout)
        self._copiers = ThreadPoolExecutor(
            copy_threads or _default_copy_threads(), thread_name_prefix="colocar-ckpt-copy"
        )

    # --- listing ------------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        """Committed steps of either layout, ascending (steps being written or abandoned, and
        unfinished Orbax steps, are not listed)."""
        return self.catalog.committed()

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The user metadata saved with `step` (default: the latest)."""
        return self.catalog.committed_manifest(step)[1].get("metadata") or {}

    def delete(self, step: int) -> None:
        """Deletes a step: its commit marker first, so it is never half-restorable."""
        holder = self.catalog.holder(step)
        (holder or self.steps).delete(step)

    # --- saving -------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        return step % self.save_interval_steps == 0 or self._preempted

    def save(
        self, step: int, state: Any, *, metadata: dict[str, Any] | None = None, force: bool = False
    ) -> bool:
        """Saves `state` as `step`; returns once every shard is in host memory (the caller may
        then donate or overwrite its device buffers). Returns False when `save_interval_steps`
        skips this step. Raises the error of an earlier save that failed in the background."""
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed")
        if not force and not self.should_save(step):
            return False
        started = time.monotonic()
        with self._lock:
            self._saves += 1  # every process counts the same saves (SPMD): this names the save in all
            try:
                if self._lease.lost:
                    raise CheckpointError(self._lease.lost)
                self._inflight.reap()
                while len(self._inflight.saves) > (1 if self.queue else 0):
                    self._inflight.wait_one(self._inflight.saves[0], timeout=None)
                if self.topology.leader and self._lease.acquire():  # one lease per job: the leader's
                    self._fenced += self._writers.fence_others()  # earlier holders' writers stop first
                if any(s.step == step for s in self._inflight.saves) or self.catalog.holder(step):
                    raise CheckpointError(
                        f"step {step} already exists in {self.storage.url}; delete it first"
                    )
                attempt = self.topology.attempt(
                    step,
                    functools.partial(self._clear_failed_save, step),
                    self._attempt_key(),
                    self.options.commit_timeout,
                )
            except BaseException as e:
                self.topology.refuse(self._attempt_key(), e)  # the others stop waiting for it
                if isinstance(e, ColocarError) and not isinstance(e, CheckpointError | StorageError):
                    raise save_failed(step, f"{type(e).__name__}: {e}") from e  # e.g. a host lost
                raise
            record = self._start(step, state, metadata or {}, started, attempt)
            self._inflight.saves.append(record)
            self._last = record.stats
        return True

    def save_held(self, step: int, held: from_blocks.Held, *, metadata: dict[str, Any] | None = None) -> bool:
        """Saves `step` from arrays already in the hosts' arenas (`held`, e.g. a snapshot's
        blocks: `Snapshots.save_to`), as `save` does but without copying from the devices."""
        return self.save(step, held, metadata=metadata, force=True)

    def _clear_failed_save(self, step: int) -> None:
        """What an earlier, failed save of `step` left goes before this save writes anything."""
        try:
            self.steps.clear_failed_save(step)
        except Exception as e:
            raise CheckpointError(f"removing what a failed save of step {step} left failed: {e}") from e

    def _attempt_key(self) -> str:
        return f"colocar/checkpoint/{self.storage.url}/{self._ordinal}/{self._saves}"

    @staticmethod
    def _kv() -> Any:
        """JAX's distributed key-value store (Orbax uses it too; no public API offers one)."""
        from colocar.jax_compat import distributed_client

        client = distributed_client()
        if client is None:
            raise CheckpointError(
                "several JAX processes but no jax.distributed client: call jax.distributed.initialize()"
            )
        return client

    def _start(self, step: int, state: Any, metadata: dict[str, Any], started: float, attempt: str) -> Save:
        if isinstance(state, from_blocks.Held):
            plan, skeleton = state.plan(self.cluster, self._chunk_bytes())
        else:
            named, skeleton, dirs = tree.flatten(state)
            plan = save.plan(named, dirs, self.cluster, self._chunk_bytes(), host_data=self.topology.leader)
        pieces = {self.topology.storage_id(h): p for h, p in plan.pieces.items()}  # this process's hosts
        hosts = self.topology.save_hosts(list(pieces))
        manifest: dict[str, Any] = {
            **layout.FORMAT_FIELDS,  # format and array_layout
            "step": step,
            "attempt": attempt,
            "time": time.time(),
            "hosts": hosts,
            "tree": skeleton,
            "leaves": plan.leaves,
            "metadata": tree.json_value("metadata", metadata),
            "jax_version": jax.__version__,
        }
        if self.layout == "orbax":
            orbax_files.annotate(manifest, self.item)  # Orbax's names and key paths; refuses clashes
            if not isinstance(state, from_blocks.Held):
                shardings.add_shardings(manifest["leaves"], named)
        record = Save(step, hosts, started, SaveStats(step=step), attempt)
        try:
            self.topology.check_fits(pieces)
            record.writers = self._writers.for_save(list(pieces))
            record.begun = time.monotonic()
            self._begin(record, json.dumps(manifest).encode())
            if isinstance(state, from_blocks.Held):
                from_blocks.send(record, pieces, state, self._senders)
            else:
                self._send(record, pieces)
        except Exception as e:
            error = e if isinstance(e, CheckpointError) else save_failed(step, f"{type(e).__name__}: {e}")
            self._inflight.abort(record, str(error))
            for h in pieces:  # the committing sidecar and the other processes stop waiting at once
                self._inflight.mark_failed(record, h, str(error))
            self._inflight.forget(record)
            if error is e:
                raise
            raise error from e
        record.stats.blocked_seconds = time.monotonic() - started
        return record

    def _begin(self, record: Save, manifest: bytes) -> None:
        """Every writer of this process learns the step's plan; the primary's first, so the
        plan is recorded before anything else is written."""
        writers, primary = record.writers, self.topology.primary
        if primary in writers:
            writers[primary].begin(record.step, manifest, record.hosts, True)
        others = [
            writers[h].begin.submit(record.step, manifest, record.hosts, False)
            for h in writers
            if h != primary
        ]
        for future in others:
            future.result()

    def _send(self, record: Save, pieces: dict[int, list[Piece]]) -> None:
        """Copies every host's pieces into its arena and hands them to its writer, one thread
        per host (the copies share the copy threads); adds up what it cost."""
        step, stats = record.step, record.stats

        def send(h: int) -> save.SendStats:
            check = functools.partial(self._inflight.wait_hosts, record, 0.0)  # raises once the save failed
            writer = record.writers[h]
            futures, sent = save.send(
                self.topology.host(h), writer, step, pieces[h], self.pool, check, self._copiers
            )
            for future in futures:
                future.result()
            if not sent.finished:
                writer.finish(step, sent.pieces)
            return sent

        for future in [self._senders.submit(send, h) for h in record.writers]:
            sent = future.result()
            stats.bytes += sent.bytes
            stats.pieces += sent.pieces
            stats.arena_waits += sent.arena_waits
            stats.arena_wait_seconds += sent.arena_wait_seconds

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until every save so far is committed (durable); raises if one failed."""
        with self._lock:
            self._inflight.wait_all(timeout)

    def stats(self) -> dict[str, Any]:
        """The last save's and restore's figures (see `SaveStats`)."""
        with self._lock:
            self._inflight.reap(raise_errors=False)
            return {"save": asdict(self._last), "restore": asdict(self._restore_stats)}

    # --- restoring ----------------------------------------------------------------------------
    def restore(self, step: int | None = None, target: Any = None, *, keys: list[str] | None = None) -> Any:
        """The state saved at `step` (default: the latest committed one).

        `target`: a pytree of `jax.ShapeDtypeStruct`s with shardings (or arrays) naming what to
        restore and where; it may shard differently than the save, over other devices, and hold
        a subset of the saved keys; a `None` in it returns that key's saved subtree as saved
        (a data iterator's state; `colocar.checkpoint.abstract` builds such targets). Without
        it, arrays come back with their saved shardings (the same devices must exist) as plain
        dicts and lists; `keys` restricts that to some top-level keys.
        """
        step, manifest, steps = self.catalog.committed_manifest(step)
        where = (self.storage.url, functools.partial(steps.read_spec, step, manifest), self.storage_timeout)
        restored, self._restore_stats = restore_tree(step, manifest, target, keys, self.cluster, where)
        return restored

    # --- writers, lease, preemption -----------------------------------------------------------
    def _chunk_bytes(self) -> int:
        if not self.max_chunk_bytes:  # given, or computed once (arena sizes do not change)
            self.max_chunk_bytes = self.topology.chunk_bytes()
        return self.max_chunk_bytes

    def _install_preemption_handler(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise CheckpointError("save_on_preemption needs the manager to be created in the main thread")

        def on_sigterm(signum: int, frame: Any) -> None:
            self._preempted = True

        self._previous_handler = signal.signal(signal.SIGTERM, on_sigterm)

    def reached_preemption(self, step: int | None = None) -> bool:
        """True once SIGTERM arrived (with `save_on_preemption`): save now, `wait()`, and exit."""
        return self._preempted

    def _warn_of_holder(self) -> None:
        """Says at creation, not at the first save, that another manager holds the lease."""
        conflict, wait = self._lease.conflict()
        if conflict and wait:
            message = (
                f"the first save waits up to {wait:.0f} s for the session of the manager holding "
                f"the lease to lapse on its sidecar (a restart right after a crash), else: {conflict}"
            )
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        elif conflict:
            warnings.warn(f"this manager cannot save yet: {conflict}", RuntimeWarning, stacklevel=3)

    def close(self) -> None:
        """Waits for saves in flight, then releases the lease and deletes the writers."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._lease.release()
            for record in list(self._inflight.saves):
                self._inflight.forget(record)
            self._writers.close()
            self._senders.shutdown(wait=False)
            self._copiers.shutdown(wait=False)
            if self._previous_handler is not None:
                signal.signal(signal.SIGTERM, self._previous_handler)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({self.storage.url!r}, hosts={len(self.cluster.hosts)})"
