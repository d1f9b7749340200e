"""One process's part of a multi-controller snapshot: its pieces, and its refill (controller).

`plan` lists this process's addressable shards, each distinct one once (replicated arrays too:
every process then restores its own devices from its own host), and the record a restore
(and a storage save, `save.py` here) needs. `refill` brings back what replaced sidecars
lost, keeper to keeper: first each process's own shards from a peer's replica, then the
replicas its peers should hold, each round ended by an exchange (the restore itself:
`restore.py` here).
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import cloudpickle
import jax
import numpy as np

from colocar.checkpoint.format import tree
from colocar.checkpoint.saves.plan import Piece, shard_bounds
from colocar.controller_bridge.arrays import addressable_shards
from colocar.errors import SnapshotError

from . import agree, save


def plan(
    step: int, attempt: str, state: Any, process: int, peers: list[int], cluster: Any
) -> tuple[list[Piece], bytes]:
    """This process's pieces of `state` and its record (pickled), with what a storage save of
    it needs (`save.storage_fields`; `cluster`: this process's) and how many processes
    take the step (a job restarted with fewer then knows whose shards to read from replicas)."""
    named, skeleton, dirs = tree.flatten(state)
    pieces: list[Piece] = []
    leaves: dict[str, dict[str, Any]] = {}
    values: dict[str, Any] = {}
    for index, (key, leaf) in enumerate(named):
        if not isinstance(leaf, jax.Array):
            values[key] = leaf
            continue
        if tree.is_prng_key(leaf):
            raise SnapshotError(f"snapshot of step {step}: leaf {key} is a PRNG key; store its key_data")
        shape = tuple(int(n) for n in leaf.shape)
        dtype = np.dtype(leaf.dtype)
        leaves[key] = {"index": index, "shape": list(shape), "dtype": dtype.name}
        seen = set()
        for shard in addressable_shards(leaf):
            bounds = shard_bounds(shard.index, shape)
            if str(bounds) in seen:
                continue
            seen.add(str(bounds))
            local = tuple(slice(0, b - a) for a, b in bounds)
            pieces.append(Piece(index, bounds, shard.data, local, tuple(b - a for a, b in bounds), dtype))
    try:
        pickled = cloudpickle.dumps(values)
    except Exception as e:
        raise SnapshotError(f"snapshot of step {step}: a plain leaf cannot be stored: {e}") from e
    record = {
        "step": step,
        "attempt": attempt,
        "time": time.time(),
        "process": process,
        "processes": jax.process_count(),
        "keys": [k for k, _ in named],
        "tree": skeleton,
        "leaves": leaves,
        "values": pickled,
        "shards": [(p.leaf, p.bounds) for p in pieces],
        "replicas": peers,
        "jax_version": jax.__version__,
        **save.storage_fields(named, dirs, cluster),
    }
    return pieces, pickle.dumps(record)


def refill(snaps: Any, step: int, attempt: str) -> int:
    """Refills the keepers that lost their part of (step, attempt), as agreed from the last
    survey (`snaps._summaries`); returns the bytes this process's keeper sent."""
    first, second = agree.refills(snaps._summaries, step, attempt, snaps.targets)
    if not first and not second:
        return 0
    me = snaps.process
    error = ""  # raised by every process after the round's exchange, never by one alone
    try:
        if any(receiver == me for _, _, receiver in first + second):
            snaps.keeper.prepare(step, attempt, [tuple(t) for t in snaps._peers])
    except Exception as e:  # noqa: BLE001 - every process hears of it below
        error = f"process {me} preparing its keeper: {type(e).__name__}: {e}"
    addresses = {t.host: t for t in snaps._peers}
    sent = 0
    for round_, moves in (("refill", first), ("re-replicate", second)):
        for sender, source, receiver in moves:
            if sender != me or error:
                continue
            target = addresses.get(receiver) or _target_of(snaps, receiver)
            try:
                sent += snaps.keeper.push(step, attempt, source, tuple(target))
            except Exception as e:  # noqa: BLE001 - every process hears of it below
                error = error or f"process {me} sending host {source}'s shards to {receiver}: {e}"
        said, error = snaps._exchange.allgather(error, f"{round_} of step {step}"), ""
        if any(said):
            raise SnapshotError(f"snapshot step {step}: {round_} failed: {[s for s in said if s][0]}")
    return sent


def _target_of(snaps: Any, process: int) -> Any:
    """The keeper of `process` (not among this process's peers: reached by its address)."""
    from ..keepers.peers import Target

    address = snaps._addresses[process]
    return Target(process, address, snaps._keeper_name(process))
