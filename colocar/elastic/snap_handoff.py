"""Getting a take's blocks to the keepers (runs in the controller; `Snapshots.take` calls it).

The usual way (`place`, then `hand_off` in the committer's background thread): each host's
pieces are copied into one new block of its pool before the keepers hear of the step; then
every keeper learns the step and drops what is not kept (`begin`), and only then takes its
host's block (a peer's replica may arrive as soon as one host has its block). When
a pool has no room for one more snapshot next to the kept ones, or for a first take
(`take_waiting`): the keepers first drop what is not kept, the fit is checked against the
pools' free bytes, then the pieces are copied and handed over at once (`send`).
"""

from __future__ import annotations

from typing import Any

from .peers import Target
from .snap_take import Placed, Planned, hand, misfit, on_each
from .snap_take import place as place_on
from .snap_take import send as send_to


def place(snaps: Any, planned: Planned) -> dict[int, Placed] | None:
    """Every host's pieces copied into a new block of its pool, one thread per host, before
    the keepers hear of the step; None (nothing kept) when a host does not map its arena or
    its pool has no room now."""
    hosts = [snaps.cluster.hosts[h] for h in planned.pieces]
    if not all(host.connection.blocks.mapped for host in hosts):
        return None

    def one(h: int) -> Placed:
        return place_on(snaps.cluster.hosts[h], planned.pieces[h], snaps.pool, snaps._copiers)

    try:
        placed, full = on_each(snaps._senders, one, planned.pieces)
        if not full:
            return placed
        placed.clear()  # the blocks go back before anything waits for room
    finally:
        for host in hosts:
            host.connection.releases.reclaimer.flush()
    return None


def hand_off(snaps: Any, planned: Planned, placed: dict[int, Placed]) -> None:
    """Background, once the previous snapshot ended: every keeper learns the step and drops
    what is not kept (all of them first: a peer's replica may come as soon as a host has its
    block), then takes its host's block and starts replicating it."""
    begin(snaps, planned, snaps._kept(planned.step))
    futures = [hand(snaps._keepers[h], planned.step, planned.pieces[h], placed.pop(h)) for h in list(placed)]
    for future in futures:
        future.result()


def take_waiting(snaps: Any, planned: Planned) -> str | None:
    """A take with no room for one more snapshot (or the first one): drops what is
    not kept, checks the fit, then copies and hands over; the reason when it does not fit."""
    hosts = list(planned.pieces)
    begin(snaps, planned, snaps._kept(planned.step))
    reason = misfit(planned, snaps._pools(hosts), snaps.pool)
    if reason is None:
        reason = send(snaps, planned)
    if reason is None:
        snaps._committer.track(planned.step, hosts, planned.record)
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
