"""How the processes of a multi-controller job agree on snapshots (runs in the controller).

Each process sees only its own sidecar's keeper. They exchange small JSON summaries through
the key-value store of `jax.distributed` (`Exchange.allgather`): what each keeper holds, per
source host and step, complete with its record. From the same summaries every process computes
the same answers: the newest step complete everywhere (every process's shards held by itself or
by a peer's replica, all of the same attempt), and which keeper refills which (`refills`). A
process whose keeper cannot be read still takes part, with a summary saying so (`unreadable`):
every process then finds no step complete (a process raising alone would leave the others
waiting in the exchange, then falling back to storage without it).
"""

from __future__ import annotations

import json
import pickle
import threading
from collections import defaultdict
from typing import Any

from colocar.controller_bridge import liveness
from colocar.errors import ProcessLostError, SnapshotError

from ..keepers.held import key_of

Summary = dict[str, Any]  # {"own": {step: attempt}, "replicas": {source: {step: attempt}}}
_made: dict[str, int] = defaultdict(int)  # per key prefix: instances made in this process
_made_lock = threading.Lock()


class Exchange:
    """All-gathers strings among the JAX processes; every process must call it the same
    number of times in the same order (as it takes and restores the same snapshots)."""

    def __init__(self, prefix: str, timeout: float):
        import jax

        from colocar.jax_compat import distributed_client

        self.process, self.processes = jax.process_index(), jax.process_count()
        self.timeout = timeout
        with _made_lock:
            self.prefix = f"{prefix}/{_made[prefix]}"
            _made[prefix] += 1
        self.rounds = 0
        self._client = distributed_client()
        if self._client is None:
            raise SnapshotError("multi-controller snapshots need jax.distributed.initialize() first")
        liveness.beat(self._client)  # from now on the peers can tell this process's death

    def allgather(self, value: str, what: str) -> list[str]:
        """Every process's `value` of this round, in process order. `what` names the round in
        the error raised when a process does not come within `timeout`; a process that died
        raises `ProcessLostError` within seconds instead (`liveness.py`)."""
        key = f"{self.prefix}/{self.rounds}"
        self.rounds += 1
        self._client.key_value_set(f"{key}/{self.process}", value)
        out = []
        for q in range(self.processes):
            if q == self.process:
                out.append(value)
                continue
            try:
                out.append(liveness.get(self._client, f"{key}/{q}", q, self.timeout))
            except ProcessLostError:
                raise
            except Exception as e:
                raise SnapshotError(
                    f"snapshots ({what}): JAX process {q} did not come within {self.timeout:.0f} s "
                    f"({e}); every process must take and restore the same snapshots in the same order"
                ) from e
        if self.rounds > 2:  # everyone read the round before last: this process's value can go
            try:
                self._client.key_value_delete(f"{self.prefix}/{self.rounds - 3}/{self.process}")
            except Exception:  # noqa: BLE001 - a few bytes stay
                pass
        return out

    def leader_value(self, value: str, what: str) -> str:
        """Process 0's `value` (the others' are ignored)."""
        return self.allgather(value, what)[0]


def complete(record: bytes | None, keys: list[Any]) -> dict[str, Any] | None:
    """The record (unpickled) when present and every shard it lists is among `keys`."""
    if record is None:
        return None
    unpickled: dict[str, Any] = pickle.loads(record)
    held = {key_of(*k) for k in keys}
    if all(key_of(leaf, bounds) in held for leaf, bounds in unpickled["shards"]):
        return unpickled
    return None


def summarize(holdings: dict[int, dict[str, Any]]) -> Summary:
    """What a keeper holds complete (its `holdings_by_source`), as an exchangeable summary,
    with the number of processes that took each step (its records say)."""
    own: dict[str, str] = {}
    replicas: dict[str, dict[str, str]] = defaultdict(dict)
    processes: dict[str, int] = {}
    for step, info in holdings.items():
        for source, held in [(None, info["own"]), *info["replicas"].items()]:
            record = complete(*held)
            if record is None:
                continue
            if source is None:
                own[str(step)] = info["attempt"]
            else:
                replicas[str(source)][str(step)] = info["attempt"]
            processes[str(step)] = max(processes.get(str(step), 0), int(record.get("processes", 0)))
    return {"own": own, "replicas": dict(replicas), "processes": processes}


def unreadable(process: int, error: BaseException) -> Summary:
    """The summary of a keeper that could not be read: it holds nothing any process counts on,
    and says why (`agreed` then finds no step, in every process alike)."""
    return {"own": {}, "replicas": {}, "error": f"process {process}: {type(error).__name__}: {error}"[:500]}


def errors(summaries: list[Summary]) -> list[str]:
    """Why keepers could not be read, per process that could not read its own."""
    return [s["error"] for s in summaries if s.get("error")]


def gather(exchange: Exchange, summary: Summary) -> list[Summary]:
    return [json.loads(s) for s in exchange.allgather(json.dumps(summary), "survey")]


def holders(summaries: list[Summary], step: int, attempt: str, source: int) -> list[int]:
    """The processes whose keepers hold `source`'s shards of (step, attempt): itself first
    (a `source` beyond this job's processes, a host the job restarted without, only as
    replicas)."""
    mine = source < len(summaries) and summaries[source]["own"].get(str(step)) == attempt
    out = [source] if mine else []
    for r, summary in enumerate(summaries):
        if r != source and summary["replicas"].get(str(source), {}).get(str(step)) == attempt:
            out.append(r)
    return out


def sources_of(summaries: list[Summary], step: int) -> range:
    """The processes whose shards `step` needs: this job's, and more when it restarted with
    fewer than took it (its records say how many did)."""
    took = [int(s.get("processes", {}).get(str(step), 0)) for s in summaries]
    return range(max([len(summaries), *took]))


def absent(summaries: list[Summary], step: int) -> list[int]:
    """The sources of `step` that are not among this job's processes (read from replicas)."""
    return list(sources_of(summaries, step))[len(summaries) :]


def agreed(summaries: list[Summary]) -> list[tuple[int, str]]:
    """(step, attempt) of the snapshots complete everywhere (every process that took it held
    by itself or a replica), oldest first; none when a process could not read its keeper
    (what it holds is unknown, so no step is known whole)."""
    if errors(summaries):
        return []
    candidates: set[tuple[int, str]] = set()
    for summary in summaries:
        candidates |= {(int(s), a) for s, a in summary["own"].items()}
        for held in summary["replicas"].values():
            candidates |= {(int(s), a) for s, a in held.items()}
    found = {}
    for step, attempt in sorted(candidates):
        if all(holders(summaries, step, attempt, q) for q in sources_of(summaries, step)):
            found[step] = attempt  # the same step complete under two attempts: either will do
    return sorted(found.items())


def refills(
    summaries: list[Summary], step: int, attempt: str, targets: dict[int, list[int]]
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """Two rounds of (sender, source, receiver): first each process missing its own shards
    gets them from a holder of their replica; then each process's shards go again to the
    peers (`targets`) that lost their replica."""
    first, second = [], []
    for q in range(len(summaries)):
        found = holders(summaries, step, attempt, q)
        if not found:
            raise SnapshotError(f"snapshot step {step}: no process holds the shards of process {q}")
        if found[0] != q:
            first.append((found[0], q, q))
        for t in targets.get(q, []):
            if t not in found:
                second.append((q, q, t))
    return first, second
