"""That the JAX processes sharing a mesh load the same thing from the same place (runs in the
controller).

With multi-controller JAX each process feeds only its own devices' rows of every global
batch. Processes whose configs or positions differ would put other records next to each
other's in one global batch: a silent wrong value. So the iterator checks, when it starts and
at every `get_state`/`set_state`, that all processes of its mesh hold the same value, through
jax.distributed's key-value store: each process publishes its value, the mesh's first process
compares them and publishes the verdict, which every process reads (a fixed number of keys per
process, no collective on the devices). A process that does not come within `timeout` seconds
is an error naming it, not a hang; one that died ends the wait within seconds
(`ProcessLostError`, `controller_bridge/liveness.py`).
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import time
from typing import Any

from colocar.controller_bridge import liveness
from colocar.errors import ColocarError, ProcessesDisagree, ProcessLostError

OK = "ok"

# Per set of processes: iterators over meshes spanning the same processes are made in the same
# order in each of them (SPMD), so the n-th one has the same keys everywhere.
_made: collections.defaultdict[tuple[int, ...], itertools.count] = collections.defaultdict(itertools.count)


class Agreement:
    """The checks of one iterator across the JAX processes of its mesh (a no-op for one)."""

    def __init__(self, processes: list[int], process: int, timeout: float):
        self.processes = sorted(processes)
        self.process = process
        self.timeout = timeout
        self._client: Any = None
        self._calls: collections.Counter[str] = collections.Counter()
        group = tuple(self.processes)
        self._prefix = f"colocar/loaders/{'-'.join(map(str, group))}/{next(_made[group])}"
        if len(self.processes) > 1:
            from colocar.jax_compat import distributed_client

            self._client = distributed_client()
            if self._client is None:
                raise ColocarError(
                    f"the mesh spans JAX processes {self.processes} but this process has no "
                    "jax.distributed client: call jax.distributed.initialize() first"
                )
            liveness.beat(self._client)

    def check(self, what: str, value: Any) -> None:
        """Returns when every process of the mesh checked `what` with an equal `value` (JSON);
        else raises `ProcessesDisagree` in every process, naming the first one that differs."""
        if self._client is None:
            return
        n = self._calls[what]
        self._calls[what] += 1
        key = f"{self._prefix}/{what}/{n}"
        mine = json.dumps(value, sort_keys=True)
        client = self._client
        self._publish(f"{key}/{self.process}", mine, what)
        leader = self.processes[0]
        if self.process == leader:
            try:
                verdict = self._compare(key, what, mine)
            except ProcessLostError as e:  # the others hear of it at once
                self._publish(f"{key}/verdict", str(e), what)
                raise
            self._publish(f"{key}/verdict", verdict, what)
            if verdict == OK and n > 0:
                self._forget(f"{self._prefix}/{what}/{n - 1}")
        else:
            # the leader may come up to `timeout` late, then wait up to `timeout` for the others
            try:
                verdict = liveness.get(client, f"{key}/verdict", leader, 2 * self.timeout)
            except ProcessLostError:
                raise
            except Exception as e:
                verdict = f"JAX process {leader} did not check {what} within {2 * self.timeout:.0f} s ({e})"
        if verdict != OK:
            raise ProcessesDisagree(
                f"{what} of the input pipeline, JAX process {self.process}: {verdict}. Every process "
                "must make the same loaders.load(...) and get_state/set_state calls, in the same order"
            )

    def _publish(self, key: str, value: str, what: str) -> None:
        try:
            self._client.key_value_set(key, value)
        except Exception as e:
            raise ColocarError(
                f"{what} of the input pipeline, JAX process {self.process}: jax.distributed's "
                f"key-value store did not take {key}: {e}"
            ) from e

    def _forget(self, key: str) -> None:
        """Deletes a past check's keys, so that a long run's store does not grow: every process
        published this check's value, so each one has read the previous check's verdict."""
        try:
            self._client.key_value_delete(key)
        except Exception:
            pass  # only a few bytes stay

    def _compare(self, key: str, what: str, mine: str) -> str:
        """The leader's verdict: OK, or what the first differing (or absent) process has."""
        deadline = time.monotonic() + self.timeout
        for p in self.processes[1:]:
            wait_ms = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                theirs = liveness.get(self._client, f"{key}/{p}", p, wait_ms / 1000)
            except ProcessLostError:
                raise
            except Exception as e:
                return f"JAX process {p} did not check {what} within {self.timeout:.0f} s ({e})"
            if theirs != mine:
                return f"JAX process {p} has {theirs}, process {self.processes[0]} has {mine}"
        return OK


def identity(config: Any, mesh: Any, axes: Any, start: int) -> dict[str, Any]:
    """What every JAX process of the mesh must agree on to load parts of the same global batches."""
    try:
        # an object JSON cannot hold counts by its type: a repr may differ between processes
        text = json.dumps(config.to_dict(), sort_keys=True, default=lambda o: f"<{type(o).__name__}>")
        digest = hashlib.sha256(text.encode()).hexdigest()
    except (TypeError, ValueError):  # not JSON-able: the options below are compared still
        digest = None
    return {
        "next_batch": start,
        "global_batch_size": config.global_batch_size,
        "seed": config.seed,
        "shuffle": config.shuffle,
        "shuffle_order": config.shuffle_order,
        "num_epochs": config.num_epochs,
        "config_sha256": digest,
        "mesh": {str(name): int(size) for name, size in mesh.shape.items()},
        "devices": [int(d.id) for d in mesh.devices.flat],
        "batch_axes": list(axes),
    }
