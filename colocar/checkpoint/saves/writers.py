"""The manager's writers: one long-lived writer object per host, kept across saves (controller).

A writer (`backends.writer.CheckpointWriter`) is a detached object in its host's sidecar: it
outlives the trainer long enough to commit a save the trainer started. One per manager and host
serves every save (its jobs are keyed by step), so a save costs no object creation. A writer is
made on first use, again when its sidecar's session was renewed (a restarted sidecar lost it),
and again once it is old enough that its lifetime (`ttl`) might end before a save it starts
could: `renew_after` = commit_timeout + 600 s, `ttl` twice that. A replaced writer finishes the
saves it has, and is deleted once no save is in flight (else its lifetime ends it). When the
manager takes the directory's lease, the writers other managers left on its hosts are fenced
(`fence_others`, see `fencing`).
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from colocar.controller_bridge.func import colocated
from colocar.controller_bridge.obj import colocated_class

from ..backends.fencing import fence_writers
from ..backends.writer import CheckpointWriter, WriterOptions, import_storage
from .topology import Topology

_Writer = colocated_class(CheckpointWriter)
_fence = colocated(fence_writers)
_import_storage = colocated(import_storage)


@dataclass
class _Held:
    handle: Any
    generation: int  # of the host's connection when the writer was made
    made: float


class Writers:
    """This process's writer of each host it saves to."""

    def __init__(self, topology: Topology, url: str, options: WriterOptions, owner: str, senders: Executor):
        self.topology = topology
        self.url = url
        self.options = options
        self.owner = owner
        self.renew_after = options.commit_timeout + 600
        self._senders = senders
        self._held: dict[int, _Held] = {}
        self._retired: list[Any] = []
        self._serial = itertools.count()

    def for_save(self, hosts: list[int]) -> dict[int, Any]:
        """The writer of each of `hosts`, made (in parallel) where there is none fit to use;
        raises the first failure to make one (the ones made are kept for the next save)."""
        made = {h: self._senders.submit(self._make, h) for h in hosts if not self._usable(h)}
        failures = []
        for h, future in made.items():
            try:
                held = future.result()
            except Exception as e:
                failures.append(e)
                continue
            old = self._held.get(h)
            if old is not None:
                self._retired.append(old.handle)
            self._held[h] = held
        if failures:
            raise failures[0]
        return {h: self._held[h].handle for h in hosts}

    def _usable(self, h: int) -> bool:
        held = self._held.get(h)
        if held is None:
            return False
        fresh = time.monotonic() - held.made < self.renew_after
        return fresh and held.generation == self.topology.host(h).connection.session.generation

    def _make(self, h: int) -> _Held:
        host = self.topology.host(h)
        name = f"colocar.checkpoint/{self.owner}/{h}/{next(self._serial)}"
        generation = host.connection.session.generation
        handle = _Writer.on(host, name=name, ttl=2 * self.renew_after)(self.url, h, self.options)
        return _Held(handle, generation, time.monotonic())

    def import_storage(self) -> None:
        """Has this process's hosts import tensorstore now, as the manager is made, all at once:
        its first import holds a sidecar's GIL for ~0.3 s, which no save or restore, nor the
        calls in flight beside it, should wait on (see `colocar.sidecar.preload`). A host that
        cannot be reached is skipped: its first save says so."""
        futures = [_import_storage.on(h).submit() for h in self.topology.cluster.hosts]
        for future in futures:
            try:
                future.result()
            except Exception:
                pass

    def fence_others(self) -> int:
        """Fences the writers of this directory other managers left on this process's hosts;
        returns how many saves in progress that stopped. A host that cannot be reached is
        skipped: its writers check the lease before they commit."""
        everyone = self.topology.sole_client
        futures = [_fence.on(h).submit(self.url, self.owner, everyone) for h in self.topology.cluster.hosts]
        stopped = 0
        for future in futures:
            try:
                stopped += int(future.result())
            except Exception:
                pass
        return stopped

    def settle(self) -> None:
        """No save is in flight: deletes the writers that were replaced (best effort)."""
        retired, self._retired = self._retired, []
        for handle in retired:
            _delete(handle)

    def close(self) -> None:
        """Deletes every writer (best effort: a lost sidecar took its writer with it)."""
        self.settle()
        held, self._held = self._held, {}
        for h in held.values():
            _delete(h.handle)


def _delete(handle: Any) -> None:
    try:
        handle.close()
        handle.delete()
    except Exception:
        pass
