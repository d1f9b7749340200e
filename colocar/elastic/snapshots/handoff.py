"""Getting a take's blocks to the keepers (runs in the controller; `Snapshots.take` calls it).

The usual way (`place`, then `hand_off` in the committer's background thread): each host's
pieces are copied into one new block of its pool before the keepers hear of the step; then
each keeper, in one call, learns the step, drops what is not kept and takes its host's block
(`begin_packed`; a peer's replica that arrives before that call waits for it). When
a pool has no room for one more snapshot next to the kept ones, or for a first take
(`take_waiting`): the keepers first drop what is not kept, the fit is checked against the
pools' free bytes, then the pieces are copied and handed over at once (`send`).
Once a snapshot committed, every host gets an empty block of its packed size (`Spares`): the
next take of the same layout copies into it, with no Allocate round trip on the caller's time.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .commit import POLL_SECONDS
from .keepers.peers import Target
from .take import Placed, Planned, layout_of, misfit, on_each
from .take import place as place_on
from .take import send as send_to


def place(snaps: Any, planned: Planned) -> dict[int, Placed] | None:
    """Every host's pieces copied into its spare block or a new block of its pool (then one
    thread per host: an Allocate each), before the keepers hear of the step; None (nothing
    kept) when a host does not map its arena or its pool has no room now."""
    hosts = [snaps.cluster.hosts[h] for h in planned.pieces]
    if not all(host.connection.blocks.mapped for host in hosts):
        return None

    spares = {h: snaps._spares.pop(snaps.cluster.hosts[h]) for h in planned.pieces}

    def one(h: int) -> Placed:
        host, pieces = snaps.cluster.hosts[h], planned.pieces[h]
        return place_on(host, pieces, snaps.pool, snaps._copiers, spares[h], planned.packed[h])

    try:  # with every block at hand, the copies alone: in this thread (they use the copiers)
        runner = None if all(b is not None for b in spares.values()) else snaps._senders
        placed, full = on_each(runner, one, planned.pieces)
        if not full:
            return placed
        placed.clear()  # the blocks go back before anything waits for room
    finally:
        for host in hosts:
            host.connection.releases.reclaimer.flush()
    return None


def hand_off(snaps: Any, planned: Planned, placed: dict[int, Placed]) -> dict[int, dict[str, Any]]:
    """Background, once the previous snapshot ended: every keeper, in one call each, learns
    the step, drops what is not kept, takes its host's block and starts replicating it (a
    peer's replica that comes before a keeper's own call waits there for it: `receive`).
    Returns the hosts' statuses from those calls (each answers once replicated, or after a
    poll's time: the committer's first poll rides on the hand-off)."""
    keep, attempt = snaps._kept(planned.step), planned.record["attempt"]
    futures = {}
    for h in list(placed):  # every host of the plan (one with no piece holds no block)
        its = placed.pop(h)  # its block goes with the call
        layout = layout_of(planned.pieces[h], its) if its.block is not None else []
        peers = targets(snaps, planned.targets[h])
        futures[h] = snaps._keepers[h].begin_packed.submit(
            planned.step, attempt, keep, peers, its.block, layout, POLL_SECONDS
        )
    return {h: future.result() for h, future in futures.items()}


def take_waiting(snaps: Any, planned: Planned) -> str | None:
    """A take with no room for one more snapshot (or the first one): drops what is
    not kept, checks the fit, then copies and hands over; the reason when it does not fit."""
    hosts = list(planned.pieces)
    snaps._spares.clear(snaps.cluster)  # their room counts as free below
    begin(snaps, planned, snaps._kept(planned.step))
    reason = misfit(planned, snaps._pools(hosts), snaps.pool)
    if reason is None:
        reason = send(snaps, planned)
    if reason is None:
        snaps._committer.track(planned.step, hosts, planned.record, then=snaps._spares.after(snaps, planned))
    return reason


def begin(snaps: Any, planned: Planned, keep: list[int]) -> None:
    """Every keeper learns the new step and its peers, and drops what is not kept."""
    attempt = planned.record["attempt"]
    futures = []
    for h, peers in planned.targets.items():
        futures.append(snaps._keepers[h].begin.submit(planned.step, attempt, keep, targets(snaps, peers)))
    for future in futures:
        future.result()


def send(snaps: Any, planned: Planned) -> str | None:
    """Every host's pieces into its arena and keeper, one thread per host; the reason
    when one host's pool turned out full (then nothing of it is kept)."""
    step = planned.step

    def one(h: int) -> int:
        host = snaps.cluster.hosts[h]
        keeper, attempt = snaps._keepers[h], planned.record["attempt"]
        return send_to(host, keeper, step, attempt, planned.pieces[h], snaps.pool, snaps._copiers)

    _, full = on_each(snaps._senders, one, planned.pieces)
    if not full:
        return None
    h, e = next(iter(full.items()))
    return (
        f"snapshot of step {step} skipped: host {h} found arena pool {snaps.pool!r} full "
        f"placing {planned.own[h]} bytes ({e}); training goes on"
    )


def targets(snaps: Any, peers: list[int]) -> list[tuple]:
    """The peer keepers of `peers`, as a keeper's call takes them."""
    return [tuple(Target(t, snaps.cluster.hosts[t].address, snaps._keeper_name(t))) for t in peers]


class Spares:
    """One empty block per host, of the packed size of the last committed snapshot's pieces
    there, for the next take. Allocated in the committer's thread once the replicas are in
    place (the room the next take needs anyway); dropped when a take must first make room."""

    def __init__(self) -> None:
        self._blocks: dict[int, tuple[int, np.ndarray]] = {}  # host -> (its sidecar's generation, block)

    def pop(self, host: Any) -> np.ndarray | None:
        """The host's spare block, if its sidecar is the one that leased it."""
        found = self._blocks.pop(host.index, None)
        if found is None or found[0] != host.connection.session.generation:
            return None
        return found[1]

    def after(self, snaps: Any, planned: Planned) -> Any:
        """What the committer runs once `planned` committed: a spare for every host (of the
        sizes alone: what runs later must not hold the state's shards)."""
        sizes = {h: total for h, (_, total) in planned.packed.items()}
        return lambda: self.fill(snaps, sizes)

    def fill(self, snaps: Any, sizes: dict[int, int]) -> None:
        """An empty block of `sizes[h]` bytes for every host h that holds pieces."""
        for h, size in sizes.items():
            host = snaps.cluster.hosts[h]
            if not size or not host.connection.blocks.mapped or h in self._blocks:
                continue
            generation = host.connection.session.generation
            try:
                spec = [((size,), np.dtype(np.uint8))]
                (block,) = host.connection.blocks.empty(spec, pool=snaps.pool, timeout=0.0)
            except Exception:  # noqa: BLE001 - no room (or the host is lost): the take allocates
                continue
            self._blocks[h] = (generation, block)

    def sizes(self) -> dict[int, int]:
        """host -> bytes of its spare block."""
        return {h: block.nbytes for h, (_, block) in self._blocks.items()}

    def clear(self, cluster: Any) -> None:
        """Every spare back to its pool now."""
        hosts = [cluster.hosts[h] for h in self._blocks]
        self._blocks.clear()
        for host in hosts:
            host.connection.releases.reclaimer.flush()
