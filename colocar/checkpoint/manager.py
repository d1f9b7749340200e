"""`CheckpointManager`: async saves written by the sidecars, restores with resharding.

Runs in the controller. `save` blocks only while shards are copied device -> arena and handed
to each host's writer (a detached object in its sidecar, see `writer_backend`); the writers
store them with tensorstore, host 0's commits the step once every host's part is durable.
`wait` returns when the step is committed and raises what went wrong otherwise. One manager
writes a directory at a time (a lease object it refreshes); any number may read it.
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
from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import jax

from colocar.controller_bridge.cluster import Cluster, current_cluster
from colocar.controller_bridge.obj import colocated_class
from colocar.errors import CheckpointError, ColocarError, HostLostError

from . import layout, save, tree
from .lease import WriterLease
from .restore import RestoreStats, restore_leaves
from .save import Piece
from .storage import open_storage
from .writer_backend import CheckpointWriter, WriterOptions

_Writer = colocated_class(CheckpointWriter)


_ORDINALS: dict[str, Any] = defaultdict(itertools.count)
_NOT_STARTED = "not started: "  # what process 0 publishes instead of an attempt id when it failed


def _save_failed(step: int, error: str) -> CheckpointError:
    """The error a failed save of `step` raises (once prefixed, whoever wrote the cause)."""
    prefix = f"save of step {step} failed: "
    return CheckpointError(error if error.startswith(prefix) else prefix + error)


def _default_copy_threads() -> int:
    """Threads copying shards into the arenas: memory bandwidth stops scaling at a few."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cores))


@dataclass
class SaveStats:
    """What the last save cost; `arena_wait_seconds` > 0 means the arena was the bottleneck."""

    step: int = -1
    bytes: int = 0
    pieces: int = 0
    blocked_seconds: float = 0.0  # how long save() held the caller
    arena_waits: int = 0  # pieces that found the arena full (the budget is below the checkpoint)
    arena_wait_seconds: float = 0.0  # part of blocked_seconds spent waiting for writers to free blocks
    durable_seconds: float | None = None  # from save() to the commit marker, once known
    hosts: dict[int, dict[str, Any]] = field(default_factory=dict)


@dataclass
class _Save:
    step: int
    hosts: list[int]
    started: float
    stats: SaveStats
    attempt: str
    begun: float = 0.0
    writers: dict[int, Any] = field(default_factory=dict)  # host index -> its writer of this step


class CheckpointManager:
    """Saves and restores pytrees of `jax.Array`s (and plain values) under `directory`.

    `directory`: `gs://bucket/prefix`, `file:///path` or a local path. `max_to_keep` committed
    steps are kept (plus every `keep_period`-th); `queue=True` lets one save start while the
    previous one is still being written (else `save` waits for it). `save_on_preemption`
    records SIGTERM so that the loop can `save` a last step (see `reached_preemption`).
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
        stale_seconds: float = 60.0,
        commit_timeout: float = 600.0,
        storage_timeout: float = 30.0,
        lease_seconds: float = 60.0,
        save_on_preemption: bool = False,
    ):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be at least 1 (or None to keep all), got {max_to_keep}")
        self.directory = directory
        self.storage = open_storage(directory, storage_timeout)
        self.cluster = cluster if cluster is not None else current_cluster()
        self.save_interval_steps = save_interval_steps
        self.queue = queue
        self.pool = pool
        self.max_chunk_bytes = max_chunk_bytes
        self.storage_timeout = storage_timeout
        self.options = WriterOptions(
            concurrent_writes=concurrent_writes,
            nice=writer_nice,
            heartbeat_seconds=heartbeat_seconds,
            stale_seconds=stale_seconds,
            commit_timeout=commit_timeout,
            max_to_keep=max_to_keep,
            keep_period=keep_period,
            storage_timeout=storage_timeout,
        )
        self._id = uuid.uuid4().hex
        self._saves = 0  # save() calls past the interval check; names a save in every process
        self._ordinal = next(_ORDINALS[directory])  # managers of this directory made before, here
        self._pools: dict[int, int] = {}  # host -> bytes of the pool saves allocate from
        # Multi-controller JAX: every process saves its own shards through its own sidecar and
        # stores them as host `process_index`; process 0's sidecar commits.
        self._process, self._processes = jax.process_index(), jax.process_count()
        if self._processes > 1 and len(self.cluster.hosts) != 1:
            raise CheckpointError(
                "with several JAX processes, each one connects to its own host's sidecar only "
                f"(colocar.connect() with one address); this cluster has {len(self.cluster.hosts)} hosts"
            )
        self._senders = ThreadPoolExecutor(len(self.cluster.hosts), thread_name_prefix="colocar-ckpt-send")
        self._copiers = ThreadPoolExecutor(
            copy_threads or _default_copy_threads(), thread_name_prefix="colocar-ckpt-copy"
        )
        self._inflight: deque[_Save] = deque()
        self._unreported: list[CheckpointError] = []  # failures seen by stats(), raised by save/wait
        self._last = SaveStats()
        self._restore_stats = RestoreStats()
        self._lock = threading.RLock()
        self._lease = WriterLease(self.storage, self._id, lease_seconds)
        self._preempted = False
        self._previous_handler: Any = None
        self._closed = False
        if save_on_preemption:
            self._install_preemption_handler()

    # --- listing ------------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        """Committed steps, ascending (steps being written or abandoned are not listed)."""
        steps = sorted(s for s in map(layout.parse_step_dir, self.storage.children()) if s is not None)
        return [s for s in steps if self.storage.exists(f"{layout.step_dir(s)}/{layout.COMMITTED}")]

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The user metadata saved with `step` (default: the latest)."""
        return self._manifest(self._committed_step(step))["metadata"]

    def delete(self, step: int) -> None:
        """Deletes a step: its commit marker first, so it is never half-restorable."""
        name = layout.step_dir(step)
        self.storage.delete(f"{name}/{layout.COMMITTED}")
        self.storage.delete_tree(name)

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
                self._reap()
                while len(self._inflight) > (1 if self.queue else 0):
                    self._wait_one(self._inflight[0], timeout=None)
                if any(s.step == step for s in self._inflight) or self.storage.exists(
                    f"{layout.step_dir(step)}/{layout.COMMITTED}"
                ):
                    raise CheckpointError(
                        f"step {step} already exists in {self.storage.url}; delete it first"
                    )
                if self._process == 0:  # one lease per job: process 0 writes for all
                    self._lease.acquire()
                attempt = self._attempt(step)
            except BaseException as e:
                if self._process == 0 and self._processes > 1:  # the others stop waiting for it
                    self._publish_attempt(f"{_NOT_STARTED}{type(e).__name__}: {e}")
                raise
            record = self._start(step, state, metadata or {}, started, attempt)
            self._inflight.append(record)
            self._last = record.stats
        return True

    def _attempt(self, step: int) -> str:
        """A new id for this save of `step`, the same in every JAX process. Process 0 (holding
        the lease) first removes what an earlier, failed save of the step left (the objects a
        save writes; nothing else), then publishes the id through JAX's distributed key-value
        store; the others wait for it, so they write nothing before that removal."""
        if self._process == 0:
            name = layout.step_dir(step)
            try:
                if self.storage.children(name):  # uncommitted (checked): a failed save's; ours only
                    for entry in (layout.HEARTBEAT, layout.MANIFEST):
                        self.storage.delete(f"{name}/{entry}")
                    for directory in (layout.DONE_DIR, layout.FAILED_DIR, layout.ARRAYS_DIR):
                        self.storage.delete_tree(f"{name}/{directory}")
            except Exception as e:
                raise CheckpointError(f"removing what a failed save of step {step} left failed: {e}") from e
            attempt = uuid.uuid4().hex
            if self._processes > 1:
                self._publish_attempt(attempt)
            return attempt
        try:
            attempt = str(
                self._kv().blocking_key_value_get(
                    self._attempt_key(), int(self.options.commit_timeout * 1000)
                )
            )
        except Exception as e:
            raise CheckpointError(
                f"process 0 did not start its save of step {step} within commit_timeout "
                f"({self.options.commit_timeout:.0f} s): {e}"
            ) from e
        if attempt.startswith(_NOT_STARTED):
            raise CheckpointError(
                f"process 0 could not start the save of step {step}: {attempt.removeprefix(_NOT_STARTED)}"
            )
        return attempt

    def _attempt_key(self) -> str:
        return f"colocar/checkpoint/{self.storage.url}/{self._ordinal}/{self._saves}"

    def _publish_attempt(self, value: str) -> None:
        try:
            self._kv().key_value_set(self._attempt_key(), value)
        except Exception:
            pass  # published already (a failure after the id went out): the markers tell the rest

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

    def _start(self, step: int, state: Any, metadata: dict[str, Any], started: float, attempt: str) -> _Save:
        named, skeleton = tree.flatten(state)
        plan = save.plan(named, self.cluster, self._chunk_bytes(), host_data=self._process == 0)
        pieces = {self._storage_id(h): p for h, p in plan.pieces.items()}  # the hosts of this process
        hosts = list(range(self._processes)) if self._processes > 1 else sorted(pieces)
        primary = self._primary()
        manifest = {
            "format": layout.FORMAT,
            "step": step,
            "attempt": attempt,
            "time": time.time(),
            "hosts": hosts,
            "tree": skeleton,
            "leaves": plan.leaves,
            "metadata": tree.json_value("metadata", metadata),
            "jax_version": jax.__version__,
        }
        body = json.dumps(manifest).encode()
        stats = SaveStats(step=step)
        record = _Save(step, hosts, started, stats, attempt)
        try:
            self._check_pieces_fit(pieces)
            writers = self._new_writers(record, list(pieces))
            record.begun = time.monotonic()
            if primary in writers:
                writers[primary].begin(step, body, hosts, True)  # the plan is recorded before anything else
            others = [writers[h].begin.submit(step, body, hosts, False) for h in writers if h != primary]
            for future in others:
                future.result()

            def send(h: int) -> save.SendStats:
                """Host h's part, on a thread of its own (the copies share the copy threads)."""
                check = functools.partial(self._check, record)
                futures, sent = save.send(
                    self._host(h), writers[h], step, pieces[h], self.pool, check, self._copiers
                )
                for future in futures:
                    future.result()
                writers[h].finish(step, sent.pieces)
                return sent

            for future in [self._senders.submit(send, h) for h in writers]:
                sent = future.result()
                stats.bytes += sent.bytes
                stats.pieces += sent.pieces
                stats.arena_waits += sent.arena_waits
                stats.arena_wait_seconds += sent.arena_wait_seconds
        except Exception as e:
            error = e if isinstance(e, CheckpointError) else _save_failed(step, f"{type(e).__name__}: {e}")
            self._abort(record, str(error))
            for h in pieces:  # the committing sidecar and the other processes stop waiting at once
                self._mark_failed(record, h, str(error))
            self._forget(record)
            if error is e:
                raise
            raise error from e
        stats.blocked_seconds = time.monotonic() - started
        return record

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until every save so far is committed (durable); raises if one failed."""
        with self._lock:
            self._reap()
            while self._inflight:
                self._wait_one(self._inflight[0], timeout)

    def stats(self) -> dict[str, Any]:
        """The last save's and restore's figures (see `SaveStats`)."""
        with self._lock:
            self._reap(raise_errors=False)
            return {"save": asdict(self._last), "restore": asdict(self._restore_stats)}

    def _wait_one(self, record: _Save, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._poll(record, wait=0.5):
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"step {record.step} is not committed after {timeout} s")

    def _reap(self, raise_errors: bool = True) -> None:
        """Drops saves that ended; raises the first failure not reported yet (once)."""
        while self._inflight:
            try:
                if not self._poll(self._inflight[0], wait=0.0):
                    break
            except CheckpointError as e:
                self._unreported.append(e)
        if raise_errors and self._unreported:
            raise self._unreported.pop(0)

    def _poll(self, record: _Save, wait: float) -> bool:
        """True once `record` is committed (and forgets it); raises CheckpointError if it failed."""
        primary = self._primary()
        try:
            status = self._check(record)
            if primary not in status:
                return self._poll_commit(record, status, wait)
            if status[primary]["state"] != "committed" and wait:
                status[primary] = self._status(record, primary, wait)
        except CheckpointError:
            self._forget(record)
            raise
        if status[primary]["state"] == "committed":
            # The writer's clock: from begin() to the commit marker (retention not included).
            record.stats.durable_seconds = record.begun - record.started + status[primary]["seconds"]
            record.stats.hosts = status
            self._forget(record)
            return True
        return False

    def _poll_commit(self, record: _Save, status: dict[int, dict[str, Any]], wait: float) -> bool:
        """Multi-controller, not process 0: once this process's part is durable, the commit
        marker (or another host's failure marker) in storage tells how the save ended."""
        name = layout.step_dir(record.step)
        if all(s["state"] == "done" for s in status.values()):
            if layout.marker_of(self.storage, f"{name}/{layout.COMMITTED}", record.attempt) is not None:
                record.stats.durable_seconds = time.monotonic() - record.started
                record.stats.hosts = status
                self._forget(record)
                return True
            for failed in self.storage.children(f"{name}/{layout.FAILED_DIR}"):
                body = layout.marker_of(self.storage, f"{name}/{layout.FAILED_DIR}/{failed}", record.attempt)
                if body is not None:
                    raise _save_failed(record.step, str(body.get("error", failed)))
            if time.monotonic() - record.started > self.options.commit_timeout:
                raise CheckpointError(
                    f"step {record.step} was not committed within commit_timeout "
                    f"({self.options.commit_timeout:.0f} s) of this process's part: is process 0 alive?"
                )
            time.sleep(min(wait, 0.2))
        elif wait:
            self._status(record, next(iter(record.writers)), wait)
        return False

    def _status(self, record: _Save, h: int, wait: float) -> dict[str, Any]:
        """Host h's writer's status of the save (waiting up to `wait` s for it to end); a lost
        host fails the save (aborted, marked, raised as CheckpointError)."""
        try:
            status: dict[str, Any] = record.writers[h].status(record.step, wait)
            return status
        except (HostLostError, ColocarError) as e:
            self._abort(record, f"host {h} was lost: {e}")
            self._mark_failed(record, h, f"host {h} was lost mid-save: {e}")
            raise _save_failed(
                record.step,
                f"host {h} ({self._host(h).name}) was lost mid-save ({e}); the step will not be "
                "committed, earlier steps are intact",
            ) from e

    def _check(self, record: _Save) -> dict[int, dict[str, Any]]:
        """This process's hosts' status of the save; raises (and aborts it) when one failed."""
        status: dict[int, dict[str, Any]] = {}
        for h in list(record.writers):
            status[h] = self._status(record, h, 0.0)
            if status[h]["state"] == "failed":
                self._abort(record, status[h]["error"])
                raise _save_failed(record.step, status[h]["error"])
        return status

    def _forget(self, record: _Save) -> None:
        """The save ended: its writers are no longer needed."""
        if record in self._inflight:
            self._inflight.remove(record)
        for writer in record.writers.values():
            try:
                writer.close()
                writer.delete()
            except Exception:
                pass  # a lost sidecar took its writer with it
        record.writers = {}

    def _abort(self, record: _Save, reason: str) -> None:
        """Tells the writers to drop the step (best effort: some may be gone)."""
        for writer in record.writers.values():
            try:
                writer.abort(record.step, reason)
            except Exception:
                pass

    # --- restoring ----------------------------------------------------------------------------
    def restore(self, step: int | None = None, target: Any = None, *, keys: list[str] | None = None) -> Any:
        """The state saved at `step` (default: the latest committed one).

        `target`: a pytree of `jax.ShapeDtypeStruct`s with shardings (or arrays) naming what to
        restore and where; it may shard differently than the save, over other devices, and hold
        a subset of the saved keys. Without it, arrays come back with their saved shardings
        (the same devices must exist) as plain dicts and lists; `keys` restricts that to some
        top-level keys.
        """
        step = self._committed_step(step)
        manifest = self._manifest(step)
        if target is not None:
            leaves, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=tree._is_none)
            targets = {jax.tree_util.keystr(path): leaf for path, leaf in leaves}
            values, self._restore_stats = restore_leaves(
                self.storage.url, step, manifest, targets, self.cluster, self.storage_timeout
            )
            return jax.tree_util.tree_unflatten(treedef, [values[k] for k in targets])
        wanted = set(manifest["leaves"])
        if keys is not None:
            prefixes = tuple(jax.tree_util.keystr((jax.tree_util.DictKey(k),)) for k in keys)
            wanted = {k for k in wanted if k.startswith(prefixes)}
            missing = [
                k for k, p in zip(keys, prefixes, strict=True) if not any(w.startswith(p) for w in wanted)
            ]
            if missing:
                raise CheckpointError(f"keys {missing} are not in step {step}")
        values, self._restore_stats = restore_leaves(
            self.storage.url, step, manifest, dict.fromkeys(wanted), self.cluster, self.storage_timeout
        )
        skeleton = tree.prune(manifest["tree"], wanted) if keys is not None else manifest["tree"]
        return tree.rebuild(skeleton, values) if skeleton is not None else None

    def _committed_step(self, step: int | None) -> int:
        if step is None:
            latest = self.latest_step()
            if latest is None:
                raise CheckpointError(f"no committed checkpoint in {self.storage.url}")
            return latest
        if not self.storage.exists(f"{layout.step_dir(step)}/{layout.COMMITTED}"):
            raise CheckpointError(
                f"step {step} is not a committed checkpoint in {self.storage.url} "
                f"(committed: {self.all_steps()})"
            )
        return step

    def _manifest(self, step: int) -> dict[str, Any]:
        body = self.storage.read(f"{layout.step_dir(step)}/{layout.MANIFEST}")
        if body is None:
            raise CheckpointError(f"step {step} in {self.storage.url} has no manifest (corrupted)")
        manifest = json.loads(body)
        if manifest.get("format") != layout.FORMAT:
            raise CheckpointError(f"step {step}: unknown format {manifest.get('format')!r}")
        return manifest

    # --- writers, lease, preemption -----------------------------------------------------------
    def _host(self, storage_id: int) -> Any:
        if self._processes > 1:
            return self.cluster.hosts[0]
        return next(h for h in self.cluster.hosts if h.index == storage_id)

    def _pool_bytes(self, storage_id: int) -> int:
        """The size of the arena pool saves use on a host (0 when shared memory is unreachable)."""
        if storage_id not in self._pools:
            host = self._host(storage_id)
            pools = host.stats()["pools"] if host.shm else {}
            self._pools[storage_id] = pools.get(self.pool or "default", {}).get("reserved", 0)
        return self._pools[storage_id]

    def _check_pieces_fit(self, pieces: dict[int, list[Piece]]) -> None:
        for h, items in pieces.items():
            largest = max((p.nbytes for p in items), default=0)
            size = self._pool_bytes(h)
            if size and largest > size:
                raise CheckpointError(
                    f"a {largest}-byte chunk cannot fit arena pool {self.pool or 'default'!r} of host {h} "
                    f"({size} bytes): pass a smaller max_chunk_bytes or give the sidecar a larger arena"
                )

    def _chunk_bytes(self) -> int:
        if self.max_chunk_bytes:  # given, or computed once (arena sizes do not change)
            return self.max_chunk_bytes
        if self._processes > 1:  # every process must cut the same chunks: no local arena size here
            self.max_chunk_bytes = layout.MULTI_PROCESS_CHUNK_BYTES
            return self.max_chunk_bytes
        sizes = [self._pool_bytes(h.index) for h in self.cluster.hosts]
        smallest = min([s for s in sizes if s] or [layout.MAX_OUTER_CHUNK_BYTES * 4])
        self.max_chunk_bytes = max(1 << 20, min(layout.MAX_OUTER_CHUNK_BYTES, smallest // 4))
        return self.max_chunk_bytes

    def _new_writers(self, record: _Save, own: list[int]) -> dict[int, Any]:
        """A detached writer per host of this process for this save, made in parallel: it
        outlives this process long enough to commit (commit_timeout), and is deleted once the
        save ended (also when making another host's failed: they are in `record.writers`)."""
        ttl = self.options.commit_timeout + 600
        name = f"colocar.checkpoint/{self._id}/{record.step}"
        made = {}
        for h in own:
            new = _Writer.on(self._host(h), name=name, ttl=ttl)
            made[h] = self._senders.submit(new, self.storage.url, h, self.options)
        failures = []
        for h, future in made.items():
            try:
                record.writers[h] = future.result()
            except Exception as e:
                failures.append(e)
        if failures:
            raise failures[0]
        return record.writers

    def _mark_failed(self, record: _Save, host: int, error: str) -> None:
        """Tells the committing sidecar (and other processes) at once that a host's part is
        lost (best effort)."""
        body = layout.failure_body(host, record.attempt, error)
        try:
            self.storage.write(f"{layout.step_dir(record.step)}/{layout.failed_marker(host)}", body)
        except Exception:
            pass

    def _storage_id(self, cluster_index: int) -> int:
        """How a host is named in storage: its JAX process index in multi-controller JAX."""
        return self._process if self._processes > 1 else cluster_index

    def _primary(self) -> int:
        """The host whose sidecar commits: process 0's, or the cluster's first."""
        return 0 if self._processes > 1 else self.cluster.hosts[0].index

    def _install_preemption_handler(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise CheckpointError("save_on_preemption needs the manager to be created in the main thread")

        def on_sigterm(signum: int, frame: Any) -> None:
            self._preempted = True

        self._previous_handler = signal.signal(signal.SIGTERM, on_sigterm)

    def reached_preemption(self, step: int | None = None) -> bool:
        """True once SIGTERM arrived (with `save_on_preemption`): save now, `wait()`, and exit."""
        return self._preempted

    def close(self) -> None:
        """Waits for saves in flight, then releases the lease and the writers."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._lease.release()
            for record in list(self._inflight):
                self._forget(record)
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
