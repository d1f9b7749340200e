"""The snapshot keeper: a detached object per host holding snapshot blocks (runs in the sidecar).

The controller copies each of the host's shards into an arena block and hands the views to
`write` (the same call shape as the checkpoint writer's, so `save.send`-like senders fit). Once
all arrived, a background thread at lower priority copies them to the peer hosts' keepers over
the network (`peers.py`); `status` long-polls that. Blocks stay here, keyed by (step, leaf,
shard bounds), until `begin` of a later snapshot or `drop` lets them go (dropping the views
frees the blocks). `commit` stores the snapshot's small record (pickled by the controller); a
restarted controller finds committed snapshots with `holdings`, and `read` cuts the slices a
restore needs out of the blocks here. No JAX import: only the peer link pulls it in.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from typing import Any

import numpy as np

from .held import ENDED, Snap, key_of
from .lifetime import flush_dropped, preimport, watch_idle
from .peers import PeerLinks, PeerOptions, Target, lower_priority
from .stitch import Bounds, allocate, by_leaf, nbytes_of, packed_block, stitch, unpack, within


class SnapshotKeeper:
    """One per `Snapshots` and host, created detached (it outlives a lost controller)."""

    # How long a replica waits for this keeper to begin its step: one controller begins every
    # host in the same round, so only a moment (a restarted peer never will: fail soon).
    begin_wait_seconds = 10.0

    def __init__(self, host: int, pool: str, peer_options: PeerOptions, idle_seconds: float = 7200.0):
        self.host = host
        self.pool = pool or "default"
        self.idle_seconds = idle_seconds
        self._snaps: dict[int, Snap] = {}
        self._dropped: collections.deque[tuple[int, str]] = collections.deque(maxlen=64)  # (step, attempt)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._peers = PeerLinks(host, peer_options)
        preimport()
        self._closed = False
        self._touched = time.monotonic()  # the last call from a controller
        # A keeper whose lifetime ended (the sidecar dropped it) closes its peer sessions too.
        weakref.finalize(self, self._peers.close)
        threading.Thread(
            target=watch_idle, args=(weakref.ref(self), idle_seconds), name="colocar-snap-idle", daemon=True
        ).start()

    def _touch(self) -> None:
        self._touched = time.monotonic()

    def expire_if_idle(self, idle_seconds: float | None = None) -> bool:
        """Drops every snapshot once no controller called for `idle_seconds` (default: the
        keeper's; a controller that died without `close` pins no arena memory for longer);
        True if it did. This call is no controller's: it does not count as one."""
        idle = self.idle_seconds if idle_seconds is None else idle_seconds
        with self._lock:
            if time.monotonic() - self._touched <= idle or not self._snaps:
                return False
            for step in list(self._snaps):
                self._forget(step)
        self._peers.close()
        flush_dropped()
        return True

    # --- taking a snapshot ------------------------------------------------------------------
    def begin(self, step: int, attempt: str, keep: list[int], peers: list[Target]) -> None:
        """A new snapshot `step` (this `attempt` of it) whose blocks go to `peers` too; every
        snapshot here other than `keep` (the newest complete ones the controller keeps) is
        dropped first."""
        self._touch()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the snapshot keeper of host {self.host} is closed")
            for old in [s for s in self._snaps if s not in keep]:
                self._forget(old)
            self._snaps[step] = Snap(step, attempt, [Target(*p) for p in peers])
            self._changed.notify_all()
        flush_dropped()

    def begin_packed(
        self,
        step: int,
        attempt: str,
        keep: list[int],
        peers: list[Target],
        block: np.ndarray | None,
        layout: list[tuple[Any, ...]],
        wait: float = 0.0,
    ) -> dict[str, Any]:
        """`begin`, then `write_packed` (no piece when `block` is None): a host's whole
        hand-off in one call; a peer's replica that comes before it waits for it (`receive`).
        Returns the step's `status` once replicated or after `wait` s (the controller's first
        poll, in the same round trip)."""
        self.begin(step, attempt, keep, peers)
        if block is None:
            self.write(step, [], 0)
        else:
            self.write_packed(step, block, layout)
        return self.status(step, attempt, wait)

    def write(self, step: int, pieces: list[tuple[int, Any, np.ndarray]], total: int | None = None) -> None:
        """Keeps pieces (leaf, bounds, arena view in the snapshot pool) of this host's shards;
        with `total`, the last ones: replication to the peers starts."""
        self._touch()
        kept = {key_of(leaf, bounds): data for leaf, bounds, data in pieces}
        with self._lock:
            self._snap(step).own.update(kept)
        if total is not None:
            self.finish(step, total)

    def write_packed(self, step: int, block: np.ndarray, layout: list[tuple[Any, ...]]) -> None:
        """As `write` with every piece, all of them in one block (one allocation and one view
        per host instead of one per piece): `layout` lists (leaf, bounds, byte offset, shape,
        dtype) of each."""
        self.write(step, unpack(block, layout), len(layout))

    def finish(self, step: int, pieces: int) -> None:
        """Every piece was sent (`pieces` in all): replicates in the background."""
        with self._lock:
            snap = self._snap(step)
            if len(snap.own) != pieces:
                self._fail(snap, f"host {self.host} got {len(snap.own)} of {pieces} pieces of step {step}")
                return
            snap.state = "replicating" if snap.peers else "replicated"
            self._changed.notify_all()
            if not snap.peers:
                return
        threading.Thread(
            target=self._replicate, args=(snap,), name=f"colocar-snap-replicate-{step}", daemon=True
        ).start()

    def _replicate(self, snap: Snap) -> None:
        lower_priority(self._peers.options.nice)
        started = time.monotonic()
        items = [(leaf, [list(b) for b in bounds], data) for (leaf, bounds), data in snap.own.items()]
        for target in snap.peers:
            try:
                sent = self._peers.send(target, snap.step, snap.attempt, items, self._alive(snap))
            except Exception as e:
                why = f"host {self.host}: replicating step {snap.step} to host {target.host} failed: {e}"
                with self._lock:
                    self._fail(snap, why)
                return
            snap.replicated_bytes += sent
        with self._lock:
            snap.replication_seconds = time.monotonic() - started
            if snap.state != "replicating":
                return
            record, snap.pending = snap.pending, None
            snap.record = record or snap.record
        if record is not None:  # shared before "replicated": who then surveys finds it with the peers
            self._committed_here(snap.step, snap.attempt, record)
        with self._lock:
            if snap.state == "replicating":
                snap.state = "replicated"
            self._changed.notify_all()

    def _committed_here(self, step: int, attempt: str, record: bytes) -> None:
        """After this keeper committed a pending record itself (a subclass shares it)."""

    def _alive(self, snap: Snap) -> Any:
        """A check that raises once the snapshot was dropped or failed (replication stops)."""

        def check() -> None:
            if self._closed or self._snaps.get(snap.step) is not snap or snap.state == "failed":
                raise RuntimeError(f"step {snap.step} was dropped or failed on host {self.host}")

        return check

    def receive(
        self,
        step: int,
        attempt: str,
        source: int,
        leaf: int,
        bounds: Any,
        dtype: Any,
        shape: Any,
        offset: int,
        data: bytes,
    ) -> int:
        """One chunk of a block sent by `source` (a peer's keeper: a replica; this host: its
        own shard, from a controller that does not map the arena). The block is allocated in
        the snapshot pool when its first chunk arrives (chunks may come in any order) and
        counts once all its bytes did. Returns the bytes taken. It may come before this host
        began the step: it waits for that (`_await_begin`)."""
        self._await_begin(step, attempt)
        key = key_of(leaf, bounds)
        with self._lock:
            snap = self._snap(step, attempt)
            slot = snap.incoming.get((source, key))
            if slot is None:
                slot = snap.incoming[(source, key)] = [allocate(tuple(shape), dtype, self.pool), 0]
        block = slot[0]
        block.reshape(-1).view(np.uint8)[offset : offset + len(data)] = np.frombuffer(data, np.uint8)
        with self._lock:
            slot[1] += len(data)
            if slot[1] == block.nbytes and snap.incoming.pop((source, key), None) is slot:
                snap.blocks_from(source, self.host)[key] = block
        return len(data)

    def receive_many(self, step: int, attempt: str, source: int, parts: list[tuple[Any, ...]]) -> int:
        """Several chunks (leaf, bounds, dtype, shape, offset, data) in one call; returns the
        bytes taken. Pieces that came whole (small ones, several to a call) go into one new
        block (`packed_block`: one allocation, not one each), chunks of larger ones to `receive`."""
        whole, chunks = [], []
        for leaf, bounds, dtype, shape, offset, data in parts:
            if offset == 0 and len(data) == nbytes_of(shape, dtype):
                whole.append((leaf, bounds, dtype, shape, data))
            else:
                chunks.append((leaf, bounds, dtype, shape, offset, data))
        if whole:
            self._await_begin(step, attempt)
            views = packed_block(whole, self.pool)
            with self._lock:
                held = self._snap(step, attempt).blocks_from(source, self.host)
                held.update((key_of(leaf, bounds), view) for leaf, bounds, view in views)
        return sum(len(p[-1]) for p in whole) + sum(self.receive(step, attempt, source, *c) for c in chunks)

    def status(self, step: int, attempt: str, timeout: float = 0.0) -> dict[str, Any]:
        """The step's state here once replication ended (or after `timeout` s)."""
        self._touch()
        deadline = time.monotonic() + timeout
        with self._lock:
            snap = self._snaps.get(step)
            while snap is not None and snap.state not in ENDED and (left := deadline - time.monotonic()) > 0:
                self._changed.wait(left)
                snap = self._snaps.get(step)
            if snap is None or snap.attempt != attempt:
                return {
                    "state": "unknown",
                    "error": f"host {self.host} holds no step {step}",
                    "host": self.host,
                }
            return {
                "state": snap.state,
                "error": snap.error,
                "host": self.host,
                "bytes": snap.nbytes(),
                "replicated_bytes": snap.replicated_bytes,
                "replication_seconds": snap.replication_seconds,
            }

    def commit(self, step: int, attempt: str, record: bytes) -> None:
        """Every shard of `step` and its replicas are in place: its record is kept here."""
        self._touch()
        with self._lock:
            self._snap(step, attempt).record = record

    def drop(self, step: int) -> None:
        self._touch()
        with self._lock:
            self._forget(step)
        flush_dropped()

    # --- finding and reading ----------------------------------------------------------------
    def holdings(self) -> dict[int, dict[str, Any]]:
        """step -> its record (None until committed) and the keys of the blocks held here."""
        self._touch()
        with self._lock:
            return {
                s.step: {
                    "record": s.record,
                    "attempt": s.attempt,
                    "state": s.state,
                    "keys": sorted(set(s.own) | {k for r in s.replicas.values() for k in r}),
                }
                for s in self._snaps.values()
            }

    def read(self, step: int, attempt: str, requests: list[tuple[int, str, Any]]) -> list[np.ndarray]:
        """[(leaf, dtype, bounds)] -> arena arrays cut from the blocks of `step` (made by
        `attempt`) held here; each request must be covered by them."""
        self._touch()
        with self._lock:
            snap = self._snap(step, attempt)
            held = by_leaf([snap.own, *snap.replicas.values()])
        return self._cut(held, requests, f"step {step}")

    def _cut(
        self,
        held: dict[int, list[tuple[np.ndarray, Bounds]]],
        requests: list[tuple[int, str, Any]],
        what: str,
    ) -> list[np.ndarray]:
        """Each requested slice: the bytes of the one block holding it whole where they are
        contiguous (no copy), else stitched from the blocks it overlaps; KeyError on a hole."""
        out = []
        for leaf, dtype, bounds in requests:
            want = key_of(leaf, bounds)
            whole = within(want[1], held.get(want[0], []))
            if whole is not None:  # one block holds all of it: its bytes, no copy
                out.append(whole)
                continue
            result, covered = stitch(want[1], dtype, held.get(want[0], []))
            if covered != result.size:
                raise KeyError(
                    f"host {self.host} holds {covered} of {result.size} elements of leaf {leaf} "
                    f"{[list(b) for b in want[1]]} in {what}"
                )
            out.append(result)
        return out

    def write_to(
        self,
        step: int,
        attempt: str,
        save_step: int,
        save_attempt: str,
        items: list,
        extra: tuple | list = (),
    ) -> int:
        """Hands the checkpoint writer of this sidecar that began `save_attempt` at `save_step`
        views of this host's own blocks of snapshot `step`: items (leaf, bounds, held leaf, held
        bounds), and the pieces (leaf, bounds, array) in `extra` (host data the controller sends).
        The views keep their blocks until written, whatever `begin` or `drop` do."""
        from colocar.checkpoint.backends.writer import writer_for

        self._touch()
        pieces = []
        with self._lock:
            snap = self._snap(step, attempt)
            for leaf, bounds, held_leaf, held_bounds in items:
                block = snap.own.get(key_of(held_leaf, held_bounds))
                if block is None:
                    where = f"{held_leaf} {held_bounds} of step {step}"
                    raise KeyError(f"host {self.host} holds no block {where}")
                starts = [lo for lo, _ in held_bounds]
                local = tuple(slice(a - lo, b - lo) for (a, b), lo in zip(bounds, starts, strict=True))
                pieces.append((leaf, bounds, block[local] if block.ndim else block))
        pieces.extend((leaf, bounds, np.asarray(data)) for leaf, bounds, data in extra)
        writer_for(save_step, save_attempt).write(save_step, pieces, len(pieces))
        return sum(p[2].nbytes for p in pieces)

    def stats(self) -> dict[int, Any]:
        with self._lock:
            return {
                s: {"state": v.state, "bytes": v.nbytes(), "record": v.record is not None}
                for s, v in self._snaps.items()
            }

    def close(self) -> None:
        """Drops every block and closes the peer links, in the background: closing the session
        with a lost peer waits out its timeout, which would hold the controller's `close`."""
        with self._lock:
            self._closed = True
            for step in list(self._snaps):
                self._forget(step)
        threading.Thread(target=self._peers.close, name="colocar-snap-close", daemon=True).start()
        flush_dropped()

    def _await_begin(self, step: int, attempt: str) -> None:
        """Until this host began `step`'s `attempt` (the controller begins every host at once,
        and a multi-controller job's processes are not in lock-step), that attempt was dropped
        here, or `begin_wait_seconds` passed."""

        def settled() -> bool:
            begun = self._begun(self._snaps.get(step), attempt)
            return begun or self._closed or (step, attempt) in self._dropped

        with self._lock:
            self._changed.wait_for(settled, self.begin_wait_seconds)

    def _begun(self, snap: Snap | None, attempt: str) -> bool:
        """Whether a replica of `attempt` need not wait with `snap` held for its step: any
        attempt will do here (one controller begins every host at once, so another one held
        is an earlier attempt's replica, refused at once)."""
        return snap is not None

    # --- helpers (lock held) ----------------------------------------------------------------
    def _snap(self, step: int, attempt: str | None = None) -> Snap:
        snap = self._snaps.get(step)
        if snap is None or (attempt is not None and snap.attempt != attempt):
            raise KeyError(
                f"host {self.host} holds no snapshot of step {step} (dropped, or begin was not called)"
            )
        return snap

    def _fail(self, snap: Snap, error: str) -> None:
        if snap.state not in ENDED:
            snap.state, snap.error = "failed", error
            self._changed.notify_all()

    def _forget(self, step: int) -> None:
        snap = self._snaps.pop(step, None)
        if snap is not None:
            self._dropped.append((step, snap.attempt))
            self._fail(snap, f"step {step} was dropped on host {self.host}")
            snap.own.clear()  # the views go: their blocks are freed
            snap.replicas.clear()
            snap.incoming.clear()
            self._changed.notify_all()
