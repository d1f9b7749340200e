"""The snapshot keeper of a multi-controller job (runs in the sidecar).

With one JAX process per host, each process hands only its own shards to the keeper of its own
sidecar, and no controller reaches another host's keeper: what crosses hosts goes keeper to
keeper (`peers.py`). On top of `SnapshotKeeper` this keeper

* takes replicas that arrive before its own process began the step (as every keeper does,
  `receive` waits for `begin`: here because the processes are not in lock-step);
* commits its process's record once its shards are replicated, by itself, and hands it to the
  peers holding its replicas (`commit_when_replicated`, `share_record`), so a killed trainer's
  last snapshot and a replaced host's record survive with their shards;
* reports what it holds per source host (`holdings_by_source`), reads its own blocks and its
  replicas of hosts the job restarted without (`read_own`), stitches slices from its own
  blocks and the peers' (`read_across`: a restore onto another sharding, the peers' parts read
  keeper to keeper), and refills a peer from what it holds (`push`): the peer's own shards from
  the replicas held here, or this host's shards as the peer's replicas again.

For drills, `fail_reads` makes this sidecar's keepers fail their reads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .held import Snap, key_of
from .keeper import SnapshotKeeper
from .lifetime import flush_dropped
from .peers import PeerOptions, Target, send_chunks
from .stitch import by_leaf, stitch

log = logging.getLogger("colocar.elastic")
READS = ("holdings", "blocks")  # the reads `fail_reads` can make fail
_failing: set[str] = set()  # fault injection: the reads of this sidecar's keepers that raise


def fail_reads(reads: list[str]) -> None:
    """Fault injection (runs in the sidecar): this sidecar's keepers raise on `reads` from now
    on: "holdings" (what they hold), "blocks" (a slice of their own shards, for their process
    or a peer's); `[]` heals them (`faults.fail_snapshot_reads`)."""
    unknown = set(reads) - set(READS)
    if unknown:
        raise ValueError(f"reads are among {READS}, got {sorted(unknown)}")
    _failing.clear()
    _failing.update(reads)


def _fault(read: str, host: int) -> None:
    if read in _failing:
        raise OSError(f"host {host}: reading its snapshot keeper ({read}) fails (an injected fault)")


class MultiKeeper(SnapshotKeeper):
    """One per host and multi-controller `Snapshots`, created detached by that host's process."""

    begin_wait_seconds = 120.0  # the processes take their snapshots each in its own time

    def __init__(self, host: int, pool: str, peer_options: PeerOptions, idle_seconds: float = 7200.0):
        super().__init__(host, pool, peer_options, idle_seconds)
        self._peer_records: dict[tuple[int, int], tuple[str, bytes]] = {}  # (step, source) -> record

    def _begun(self, snap: Snap | None, attempt: str) -> bool:
        """Only that attempt: this host's process may begin it after a peer's did."""
        return snap is not None and snap.attempt == attempt

    def prepare(self, step: int, attempt: str, peers: list[Any]) -> None:
        """Makes room for a refill of `step` (this `attempt`): a new empty snapshot unless one
        of the same attempt is here; nothing else is dropped."""
        self._touch()
        with self._lock:
            snap = self._snaps.get(step)
            if snap is None or snap.attempt != attempt:
                self._forget(step)
                self._snaps[step] = Snap(step, attempt, [Target(*p) for p in peers], state="replicated")
            self._changed.notify_all()

    def commit(self, step: int, attempt: str, record: bytes) -> None:
        super().commit(step, attempt, record)
        with self._lock:
            snap = self._snap(step, attempt)
            if snap.state != "failed":
                snap.state = "replicated"

    def commit_when_replicated(self, step: int, attempt: str, record: bytes) -> None:
        """Commits this host's `record` of (step, attempt) and shares it with the peers holding
        its replicas once its shards are replicated: by this keeper, so a trainer killed in the
        meantime loses no snapshot that finished (a restart finds it complete)."""
        self._touch()
        with self._lock:
            snap = self._snap(step, attempt)
            if snap.state == "failed":
                return
            if snap.state != "replicated":
                snap.pending = record
                return
        self.commit(step, attempt, record)
        self._committed_here(step, attempt, record)

    def _committed_here(self, step: int, attempt: str, record: bytes) -> None:
        try:
            self.share_record(step, attempt, record)
        except Exception as e:  # noqa: BLE001 - a background thread: the peers' copies are missing
            log.warning("host %d: sharing the record of step %d failed: %s", self.host, step, e)

    def share_record(self, step: int, attempt: str, record: bytes) -> None:
        """Stores this host's record of `step` with the peers holding its replicas."""
        self._touch()
        with self._lock:
            peers = list(self._snap(step, attempt).peers)
        for target in peers:
            self._peers._keeper(target).keep_record(step, attempt, self.host, record)

    def keep_record(self, step: int, attempt: str, source: int, record: bytes) -> None:
        """`source`'s record of `step` (this host's own when `source` is this host)."""
        self._await_begin(step, attempt)
        if source == self.host:
            self.commit(step, attempt, record)
            return
        with self._lock:
            self._snap(step, attempt)
            self._peer_records[(step, source)] = (attempt, record)

    def _forget(self, step: int) -> None:
        super()._forget(step)
        for key in [k for k in self._peer_records if k[0] == step]:
            del self._peer_records[key]

    def holdings_by_source(self) -> dict[int, dict[str, Any]]:
        """step -> {"attempt", "state", "own": (record, keys), "replicas": {source: (record, keys)}}
        with records as bytes (None when not here) and keys of the complete blocks."""
        self._touch()
        _fault("holdings", self.host)
        with self._lock:
            out: dict[int, dict[str, Any]] = {}
            for s in self._snaps.values():
                replicas = {}
                for source, blocks in s.replicas.items():
                    attempt, record = self._peer_records.get((s.step, source), (s.attempt, None))
                    replicas[source] = (record if attempt == s.attempt else None, sorted(blocks))
                out[s.step] = {
                    "attempt": s.attempt,
                    "state": s.state,
                    "own": (s.record, sorted(s.own)),
                    "replicas": replicas,
                }
            return out

    def read_own(
        self, step: int, attempt: str, requests: list[tuple[int, str, Any]], absent: Sequence[int] = ()
    ) -> list[np.ndarray]:
        """[(leaf, dtype, bounds)] -> arena arrays cut from this host's own blocks of `step` and
        its replicas of the `absent` sources (hosts of the snapshot that are in the job no
        more: their shards live on only as replicas)."""
        self._touch()
        _fault("blocks", self.host)
        with self._lock:
            snap = self._snap(step, attempt)
            held = by_leaf([snap.own, *(snap.replicas.get(int(s), {}) for s in absent)])
        return self._cut(held, requests, f"its own shards of step {step}")

    def read_across(
        self,
        step: int,
        attempt: str,
        requests: list[tuple[int, str, Any, Any]],
        peers: dict[int, tuple],
        absent: Sequence[int] = (),
    ) -> list[np.ndarray]:
        """[(leaf, dtype, bounds, parts)], parts [(process, part bounds)] -> arena arrays, each
        stitched from its parts: this host's cut from its own blocks, the other processes' read
        from their keepers (`peers`: process -> Target) over the peer path, never through a
        controller (each process's parts from its own blocks and its replicas of the `absent`
        sources, as `read_own`). The parts must fill each slice exactly."""
        self._touch()
        wanted: dict[int, list[tuple[int, str, Any]]] = {}  # process -> its parts to cut
        slots = []  # per request: [(process, index in wanted[process], part)]
        for leaf, dtype, _, parts in requests:
            slot = []
            for process, part in parts:
                cut = wanted.setdefault(int(process), [])
                slot.append((int(process), len(cut), key_of(leaf, part)[1]))
                cut.append((leaf, dtype, [list(b) for b in part]))
            slots.append(slot)
        got = self._read_parts(step, attempt, wanted, peers, list(absent))
        out = []
        for (leaf, dtype, bounds, _), slot in zip(requests, slots, strict=True):
            want = key_of(leaf, bounds)[1]
            result, covered = stitch(want, dtype, [(np.asarray(got[p][i]), part) for p, i, part in slot])
            if covered != result.size:
                raise KeyError(
                    f"the parts of leaf {leaf} {bounds} of step {step} fill {covered} of {result.size}"
                )
            out.append(result)
        return out

    def _read_parts(
        self,
        step: int,
        attempt: str,
        wanted: dict[int, list[Any]],
        peers: dict[int, tuple],
        absent: list[int],
    ) -> dict[int, list[np.ndarray]]:
        """Each process's parts: the peers cut theirs at once while this host cuts its own."""
        futures = {}
        try:
            for process, cut in wanted.items():
                if process != self.host:
                    peer = self._peers._keeper(Target(*peers[process]))
                    futures[process] = peer.read_own.submit(step, attempt, cut, absent)
            got = {}
            if self.host in wanted:
                got[self.host] = self.read_own(step, attempt, wanted[self.host], absent)
            got.update({process: list(future.result()) for process, future in futures.items()})
            return got
        except BaseException:
            for future in futures.values():
                future.give_up()
            raise

    def push(self, step: int, attempt: str, source: int, target: tuple) -> int:
        """Sends `source`'s blocks of `step` held here (this host's own, or a replica) and its
        record to `target`'s keeper, which must have `prepare`d the step; returns the bytes."""
        self._touch()
        started = time.monotonic()
        with self._lock:
            snap = self._snap(step, attempt)
            blocks = snap.own if source == self.host else snap.replicas.get(source, {})
            items = [(leaf, [list(b) for b in bounds], data) for (leaf, bounds), data in blocks.items()]
            if source == self.host:
                record = snap.record
            else:
                record = self._peer_records.get((step, source), (attempt, None))[1]
        if record is None:
            raise KeyError(f"host {self.host} holds no record of host {source}'s step {step}")
        peer = self._peers._keeper(Target(*target))
        sent = send_chunks(peer, step, attempt, source, items, bandwidth=self._peers.options.bandwidth)
        peer.keep_record(step, attempt, source, record)
        with self._lock:
            snap.replicated_bytes += sent
            snap.replication_seconds += time.monotonic() - started
        flush_dropped()
        return sent
