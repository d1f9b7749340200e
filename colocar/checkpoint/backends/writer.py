"""The checkpoint writer: a detached object in each sidecar (runs in the sidecar).

One writer per manager and host serves every save of that manager, as one job per step.
The controller copies each shard into an arena block and hands the block's view to
`write`; the writer stores it with tensorstore on its own threads (bounded concurrency) and
drops the view, which frees the block, once the write is durable. After `finish` (or the last
`write` naming the total), the host writes its done marker. The primary writer (host 0's) also
holds the step's plan from `begin` on, so the commit does not depend on the trainer: it writes
the manifest, keeps the step's heartbeat fresh, waits for every planned host's done marker,
writes the commit marker last (create-only), then applies retention and removes debris of
crashed saves. `wait` is a long-poll: it returns when the step's job ended on this host (or
after its timeout). A writer outlives its trainer; once another manager holds the directory's
lease it is fenced (`fence`): its jobs stop and it never commits again (see `fencing`).
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from colocar.sidecar import instruments

from ..format import layout
from ..store.catalog import steps_of
from ..store.steps import STALE_SECONDS
from ..store.storage import Storage, describe, open_storage
from . import fencing, primary
from .trainer_watch import caller, watch_caller

TERMINAL = ("committed", "done", "failed")
_BEGUN: weakref.WeakValueDictionary[tuple[int, str], CheckpointWriter] = weakref.WeakValueDictionary()


def writer_for(step: int, attempt: str) -> CheckpointWriter:
    """The writer of this sidecar that began `attempt` at `step`: a holder of blocks in the
    same sidecar hands it views of them (`from_blocks`)."""
    writer = _BEGUN.get((step, attempt))
    if writer is None:
        raise KeyError(f"no checkpoint writer of this sidecar began step {step} (attempt {attempt})")
    return writer


def import_storage() -> None:
    """Imports tensorstore in this sidecar, if it has not yet (called as a manager is made)."""
    import tensorstore  # noqa: F401


def _lower_priority(nice: int) -> None:
    """Writer threads (and the tensorstore threads they start) yield the CPU to the trainer:
    a save is background work, and on a busy host it must not slow the training step."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        pass


def _trim_heap() -> None:
    """Returns the encode buffers tensorstore freed to the OS (glibc keeps them otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@dataclass
class WriterOptions:
    """Plain data, sent from the controller once per manager."""

    concurrent_writes: int = 2
    heartbeat_seconds: float = 5.0
    stale_seconds: float = STALE_SECONDS  # an uncommitted step without a fresher heartbeat is debris
    commit_timeout: float = 600.0  # the primary gives up waiting for other hosts' done markers
    max_to_keep: int | None = None
    keep_period: int | None = None
    storage_timeout: float = 30.0
    nice: int = 5  # scheduling priority of the writer threads (0: as the sidecar)
    owner: str = ""  # the manager whose writer this is: commits only while it holds the lease
    layout: str = "colocar"  # colocar's format, or "orbax" (Orbax's own layout: `checkpoint.orbax`)
    item: str = "default"  # in Orbax's layout, the step's one item (`checkpoint.orbax.names`)


@dataclass
class _Job:
    step: int
    primary: bool
    hosts: list[int]
    leaves: dict[int, dict[str, Any]]  # leaf index -> manifest entry (arrays only)
    manifest: bytes = b""
    attempt: str = ""  # this save of the step; markers of other attempts are ignored
    state: str = "writing"  # writing -> done (this host's part durable) -> committed | failed
    error: str = ""
    pieces_sent: int | None = None  # set by finish()
    pieces_written: int = 0
    bytes_written: int = 0
    pending: int = 0
    reported: bool = False  # the controller saw the job's end (see `wait`)
    session: str = ""  # the trainer session that began the job (see `trainer_watch`)
    started: float = field(default_factory=time.monotonic)
    finished: float = 0.0
    stores: dict[int, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    changed: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)


class CheckpointWriter:
    """One per manager and host, created detached: it outlives the trainer's session."""

    def __init__(self, url: str, host: int, options: WriterOptions):
        self.url = url
        self.host = host
        self.options = options
        self.storage: Storage = open_storage(url, options.storage_timeout)
        self.steps = steps_of(self.storage, options.layout, options.item)
        self._jobs: dict[int, _Job] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(
            options.concurrent_writes,
            thread_name_prefix="colocar-ckpt-write",
            initializer=_lower_priority,
            initargs=(options.nice,),
        )
        self._context: Any = None
        self.fenced = ""  # why this writer may not commit any more (another manager took over)
        self.commits = False  # it was given a step to commit (its manager held the lease)
        self._commit_lock = threading.Lock()  # a fence waits for a commit in progress
        fencing.register(self)

    # --- called by the controller -----------------------------------------------------------
    def begin(self, step: int, manifest: bytes, hosts: list[int], primary: bool) -> None:
        """Registers the step's plan (which hosts write it); the primary also owns its commit."""
        parsed = json.loads(manifest)
        leaves = {int(e["index"]): e for e in parsed["leaves"].values() if e["kind"] != "value"}
        for entry in leaves.values():  # where the array lies, under the attempt (`layout.array_dir`)
            entry["array_dir"] = layout.array_dir(parsed, entry)
        job = _Job(step, primary, sorted(hosts), leaves, manifest, parsed.get("attempt", ""))
        job.session = caller()
        with self._lock:
            old = self._jobs.get(step)
            if old is not None and old.state not in TERMINAL:
                raise RuntimeError(f"step {step} is already being saved on host {self.host}")
            for ended in [s for s, j in self._jobs.items() if j.reported]:
                _BEGUN.pop((ended, self._jobs.pop(ended).attempt), None)  # keeps only what may be asked
            self._jobs[step] = job
            _BEGUN[(step, job.attempt)] = self
        watch_caller(self._trainer_gone)  # after the job is known: its trainer may be gone already
        if primary:
            self.commits = True
            threading.Thread(
                target=self._primary, args=(job,), name=f"colocar-ckpt-commit-{step}", daemon=True
            ).start()

    def write(
        self, step: int, pieces: list[tuple[int, list[list[int]], np.ndarray]], total: int | None = None
    ) -> None:
        """Queues pieces (leaf index, [[start, stop], ...] in the global array, arena view);
        with `total`, these are the last ones, as `finish(step, total)` would say."""
        job = self._job(step)
        with job.lock:
            if job.state == "failed":
                return  # the step is lost already; dropping the views frees their blocks
            job.pending += len(pieces)
        for leaf, bounds, data in pieces:
            self._pool.submit(self._write_piece, job, leaf, bounds, data)
        if total is not None:
            self.finish(step, total)

    def finish(self, step: int, pieces: int) -> None:
        """No more pieces: `pieces` were sent in all; the host's part is durable after them."""
        job = self._job(step)
        with job.lock:
            job.pieces_sent = pieces
            self._check_done(job)

    def wait(self, step: int, timeout: float = 0.0) -> dict[str, Any]:
        """The step's state on this host once its job ended here (the primary's: committed or
        failed; another host's: done or failed), or after `timeout` s. A job whose end was
        reported is dropped at the next `begin`: the controller does not ask about it again."""
        job = self._job(step)
        deadline = time.monotonic() + timeout
        with job.lock:
            while not _ended(job) and (remaining := deadline - time.monotonic()) > 0:
                job.changed.wait(remaining)
            job.reported = _ended(job)
            return {
                "state": job.state,
                "error": job.error,
                "host": self.host,
                "pieces_written": job.pieces_written,
                "bytes_written": job.bytes_written,
                "pending": job.pending,
                "seconds": (job.finished or time.monotonic()) - job.started,
            }

    def abort(self, step: int, reason: str) -> None:
        job = self._jobs.get(step)
        if job is not None:
            self._fail(job, reason, marker=False)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _trainer_gone(self, session_id: str, why: str) -> None:
        """The trainer session `session_id` ended: its jobs still waiting for pieces (no
        `finish` yet) can never end, so they fail with this host's failure marker."""
        with self._lock:
            jobs = [j for j in self._jobs.values() if j.session == session_id]
        for job in jobs:
            with job.lock:
                orphaned = job.state == "writing" and job.pieces_sent is None
            if orphaned:
                self._fail(job, f"host {self.host}: saving step {job.step} failed: {why}")

    def fence(self, reason: str) -> int:
        """Another manager holds the lease now: every job in progress fails, and this writer
        never commits again; returns once no commit of it is in progress (how many jobs it
        stopped)."""
        with self._commit_lock:
            self.fenced = reason
        with self._lock:
            jobs = [j for j in self._jobs.values() if j.state not in TERMINAL]
        for job in jobs:
            self._fail(job, f"host {self.host}: {reason}", marker=False)
        return len(jobs)

    # --- writing ----------------------------------------------------------------------------
    def _job(self, step: int) -> _Job:
        job = self._jobs.get(step)
        if job is None:
            raise KeyError(f"host {self.host} has no save of step {step} (begin was not called)")
        return job

    def _ts_context(self) -> Any:
        import tensorstore as ts

        if self._context is None:
            self._context = ts.Context(self.storage.context_spec())
        return self._context

    def _spec(self, job: _Job, leaf: int) -> dict[str, Any]:
        return self.steps.write_spec(job.step, job.attempt, self.host, job.leaves[leaf])

    def _store(self, job: _Job, leaf: int) -> Any:
        import tensorstore as ts

        with job.lock:
            store = job.stores.get(leaf)
        if store is None:
            # Only the primary writes the array's metadata; the others write chunks blindly.
            spec = self._spec(job, leaf)
            store = ts.open(spec, context=self._ts_context(), open=True, assume_metadata=True).result()
            with job.lock:
                store = job.stores.setdefault(leaf, store)
        return store

    def _write_piece(self, job: _Job, leaf: int, bounds: list[list[int]], data: np.ndarray) -> None:
        try:
            if job.state == "failed":
                return
            store = self._store(job, leaf)
            store[layout.slices_of(bounds)].write(data, can_reference_source_data_indefinitely=True).result()
            with job.lock:
                job.pieces_written += 1
                job.bytes_written += data.nbytes
            instruments.bytes_written(data.nbytes)
        except Exception as e:
            key = job.leaves.get(leaf, {}).get("key", f"leaf {leaf}")
            self._fail(
                job,
                f"host {self.host}: writing {key} {bounds} of step {job.step} failed: {describe(e)}",
            )
        finally:
            del data  # frees the arena block once nothing else holds it
            with job.lock:
                job.pending -= 1
                self._check_done(job)

    def _check_done(self, job: _Job) -> None:
        """Under job.lock: writes the done marker once every sent piece is durable."""
        if job.state != "writing" or job.pieces_sent is None or job.pending:
            return
        if job.pieces_written < job.pieces_sent:
            return
        job.state = "marking"
        threading.Thread(target=self._mark_done, args=(job,), daemon=True).start()

    def _mark_done(self, job: _Job) -> None:
        _trim_heap()  # once per save: trimming between writes would make every buffer fault anew
        try:
            self.steps.mark_done(job.step, self.host, job.attempt, job.pieces_written, job.bytes_written)
        except Exception as e:
            self._fail(job, f"host {self.host}: writing the done marker of step {job.step} failed: {e}")
            return
        with job.lock:
            if job.state == "marking":
                job.state = "done"
                if not job.primary:
                    job.finished = time.monotonic()
                    instruments.save_ended("done", job.finished - job.started)
            job.changed.notify_all()

    def _fail(self, job: _Job, error: str, marker: bool = True) -> None:
        with job.lock:
            if job.state in ("failed", "committed"):
                return
            job.state, job.error, job.finished = "failed", error, time.monotonic()
            job.changed.notify_all()
        instruments.save_ended("failed")
        if marker:
            try:
                self.steps.mark_failed(job.step, self.host, job.attempt, error)
            except Exception:
                pass  # storage itself may be what failed; the error still reaches the controller

    # --- the primary: plan, heartbeat, commit, retention -----------------------------------
    def _primary(self, job: _Job) -> None:  # (its rules: `primary`)
        _lower_priority(self.options.nice)
        stop = threading.Event()
        heartbeat = threading.Thread(target=self._heartbeat, args=(job, stop), daemon=True)
        try:
            self.storage.write(self.steps.heartbeat_name(job.step, job.attempt), b"%f" % time.time())
            heartbeat.start()
            self._create_arrays(job)
            self.steps.write_manifest(job.step, job.attempt, job.manifest)
            primary.await_hosts(self.steps, job, self.options.commit_timeout)
            stop.set()
            heartbeat.join()  # no heartbeat written into a step the commit moves or finishes
            self._commit(job)
            job.finished = time.monotonic()  # durable from here on
            instruments.save_ended("committed", job.finished - job.started)
        except Exception as e:
            self._fail(job, f"host {self.host}: committing step {job.step} failed: {describe(e)}")
            return
        finally:
            stop.set()
        try:
            with self._lock:
                active = {s for s, j in self._jobs.items() if j.state not in TERMINAL}
            primary.retain(self.steps, self.options, job.step, job.attempt, active)
        except Exception as e:
            print(f"colocar checkpoint: retention after step {job.step} failed: {e}", flush=True)
        with job.lock:  # reported once retention is done too, so listings after wait() are settled
            job.state = "committed"
            job.changed.notify_all()

    def _commit(self, job: _Job) -> None:
        """Writes the commit marker unless this writer was fenced or its manager lost the lease
        (checked under the lock a fence takes, so no commit follows a fence)."""
        with self._commit_lock:
            if self.fenced:
                raise RuntimeError(self.fenced)
            fencing.check_lease(self.storage, self.options.owner)
            if job.state == "failed":
                raise RuntimeError(job.error)
            if not self.steps.commit(job.step, job.attempt, job.hosts):
                raise RuntimeError(f"step {job.step} was committed by another writer meanwhile")

    def _heartbeat(self, job: _Job, stop: threading.Event) -> None:
        name = self.steps.heartbeat_name(job.step, job.attempt)
        while not stop.wait(self.options.heartbeat_seconds):
            try:
                self.storage.write(name, b"%f" % time.time())
            except Exception:
                pass  # a failing store fails the writes too; the heartbeat only delays deletion

    def _create_arrays(self, job: _Job) -> None:
        import tensorstore as ts

        opens = []
        for leaf, e in job.leaves.items():
            spec = self._spec(job, leaf)
            opens.append((e["key"], ts.open(spec, context=self._ts_context(), create=True, open=True)))
        for key, future in opens:
            try:
                future.result()
            except Exception as error:
                raise RuntimeError(f"creating the array of {key} failed: {describe(error)}") from None


def _ended(job: _Job) -> bool:
    """Nothing more happens to the job on this host: the primary's is committed or failed,
    another host's is done (its part is durable) or failed."""
    return job.state in (("committed", "failed") if job.primary else ("done", "failed"))
