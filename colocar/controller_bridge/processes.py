"""That the JAX processes of a multi-controller array call got the same global arrays (controller).

Under multi-controller JAX each process assembles a call's outputs from its own hosts' blocks.
With `out_specs_fn` every output's shape and dtype are given, the same in every process. Under
the default rule an unsplit dimension takes the size the hosts returned, and the dtype is
theirs: a function whose sizes or dtypes depend on a host's data would give the processes
global arrays of different shapes, which later computations mix without a word (one controller
sees every host and raises instead). So the call's first process publishes the shapes and
dtypes of its array inputs and the structure, shapes and dtypes of its outputs (or that its
part failed) in jax.distributed's key-value store, and every other process compares its own
with them before returning: a difference raises there, naming both processes; other inputs
mean the processes' calls are out of step (one skipped or added a call). The first process
never waits; the others wait until it finished the same call. Keys are numbered per set of
processes and function, in the order each process starts its calls: every process makes the
same calls in the same order (SPMD), and waits for their results (the first process publishes
when it has its own). A first process that died ends the others' wait within seconds
(`ProcessLostError`, `liveness.py`), not after SYNC_TIMEOUT.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable
from typing import Any

import jax

from colocar.errors import ColocarError, ProcessesDisagree, ProcessLostError
from colocar.jax_compat import distributed_client

from . import liveness

# seconds another process waits, once its own part ended, for the first one to finish the same
# call (plus the call's timeout if it has one: the first one's part may take that long)
SYNC_TIMEOUT = 300.0
KEEP = 4096  # calls of one function whose keys the first process keeps for the others

_made: collections.Counter[str] = collections.Counter()
_made_lock = threading.Lock()


class OutputCheck:
    """One multi-controller call's comparison of outputs with its first process's."""

    def __init__(
        self, name: str, processes: Iterable[int], call_timeout: float | None = None, inputs: str = ""
    ):
        self.name = name
        self.inputs = inputs  # the array inputs' dtypes and shapes: equal in every process's same call
        self.timeout = SYNC_TIMEOUT + (call_timeout or 0.0)
        self.processes = sorted(processes)
        self.leader = self.processes[0]
        self.process = jax.process_index()
        prefix = f"colocar/calls/{'-'.join(map(str, self.processes))}/{name}"
        with _made_lock:
            self.n = _made[prefix]
            _made[prefix] += 1
        self._prefix = prefix
        self._client = distributed_client()
        if self._client is None:
            raise ColocarError(
                f"{name}: the call spans JAX processes {self.processes} but this process has no "
                "jax.distributed client: call jax.distributed.initialize() first"
            )
        liveness.beat(self._client)

    @staticmethod
    def needed(plan: Any) -> OutputCheck | None:
        """The check a call needs: one when it spans several JAX processes and the default rule
        shapes its outputs (out_specs_fn gives them; per-device shards are per-process lists)."""
        options = plan.options
        if jax.process_count() == 1 or options.out_specs_fn is not None or options.per_device_shards:
            return None
        devices = [d for x in plan.arrays for d in x.sharding.device_set] or list(options.devices or ())
        processes = {d.process_index for d in devices}
        if len(processes) < 2:
            return None
        inputs = ", ".join(f"{x.dtype}{list(x.shape)}" for x in plan.arrays)
        return OutputCheck(plan.name, processes, options.timeout, f"inputs ({inputs})")

    def failed(self, error: BaseException) -> None:
        """This process's part failed: the first process tells the others (they raise too)."""
        if self.process == self.leader:
            self._publish(f"{self.inputs}\nfailed: {type(error).__name__}: {str(error)[:500]}")

    def agree(self, result: Any) -> None:
        """Publishes (first process) or compares with the first process's (others) `result`'s
        structure, shapes and dtypes; raises `ProcessesDisagree` in a process that differs."""
        mine = signature(result)
        if self.process == self.leader:
            self._publish(f"{self.inputs}\n{mine}")
            return
        inputs, _, theirs = self._theirs().partition("\n")
        if inputs != self.inputs:
            raise ProcessesDisagree(
                f"{self.name}: the calls of JAX processes {self.leader} and {self.process} are out of "
                f"step: call number {self.n} of this function took {inputs} in process {self.leader}, "
                f"{self.inputs} here. A process skipped or added a call; every process must make the "
                "same array calls in the same order"
            )
        if theirs.startswith("failed: "):
            raise ProcessesDisagree(
                f"{self.name}: JAX process {self.leader}'s part of this call {theirs}; every process "
                "of the call fails with it"
            )
        if theirs != mine:
            raise ProcessesDisagree(
                f"{self.name}: the outputs of JAX process {self.process} differ from those of JAX "
                f"process {self.leader}: here {mine}, there {theirs}. Its hosts returned other "
                "sizes along a dimension the first array input does not split (or other dtypes) "
                "in different processes; give out_specs_fn to say the outputs' shapes"
            )

    def _key(self) -> str:
        return f"{self._prefix}/{self.n}"

    def _publish(self, value: str) -> None:
        try:
            self._client.key_value_set(self._key(), value)
        except Exception as e:
            raise ColocarError(
                f"{self.name}, JAX process {self.process}: jax.distributed's key-value store did "
                f"not take {self._key()}: {e}"
            ) from e
        if self.n >= KEEP:
            try:
                self._client.key_value_delete(f"{self._prefix}/{self.n - KEEP}")
            except Exception:
                pass  # only a few bytes stay

    def _theirs(self) -> str:
        try:  # a leader that died ends the wait within seconds (ProcessLostError)
            return liveness.get(self._client, self._key(), self.leader, self.timeout)
        except ProcessLostError:
            raise
        except Exception as e:
            raise ProcessesDisagree(
                f"{self.name}, JAX process {self.process}: JAX process {self.leader} did not finish "
                f"the same call (its call number {self.n}) within {self.timeout:.0f} s ({e}). Every "
                "process must make the same array calls in the same order"
            ) from e


def signature(result: Any) -> str:
    """The result's structure, then each array's dtype and shape (another value as "-"):
    `PyTreeDef((*, *)): float32[16, 2], -`."""
    leaves, treedef = jax.tree_util.tree_flatten(result, is_leaf=lambda x: x is None)
    arrays = [f"{x.dtype}{list(x.shape)}" if isinstance(x, jax.Array) else "-" for x in leaves]
    return f"{treedef}: {', '.join(arrays)}"
