"""Sidecar-to-sidecar bulk transfer of snapshot replicas (runs in the sidecar).

A keeper sends its blocks to a peer host's keeper directly, never through the controller: it
opens a session with the peer's sidecar like a controller would (the cluster's token, or
mutual TLS), always over gRPC (`shm=False`, even when both sidecars share a machine, so the
path is the one that runs across hosts). Each block travels as chunks of just under 1 MiB
(`send_chunks`), small blocks several to a call of the peer keeper's `receive_many`, which
writes them straight into blocks of the snapshot pool; at most `WINDOW` calls are in flight
(flow control). The sending thread runs at a lower priority than training, and `bandwidth`
(bytes/s) caps its rate. A controller that does not map a host's arena sends that host's own
shards the same way. For fault drills, `hold` stops a sidecar's keepers from sending until it
is released (`faults.hold_replication`: a replication in flight, on cue, for as long as needed).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from colocar.errors import ObjectNotFoundError
from colocar.protocol.tls import channel_credentials

CHUNK_BYTES = (1 << 20) - (16 << 10)  # a chunk and its call's arguments stay under the 1 MiB inline limit
WINDOW = 4  # calls in flight to one peer
PARTS_PER_CALL = 64  # small pieces sent in one call (their metadata stays within the margin above)
_RELEASED = threading.Event()  # cleared while `hold` holds this sidecar's replications
_RELEASED.set()


class Target(NamedTuple):
    """A peer keeper: its host index, its sidecar's address and the keeper's detached name."""

    host: int
    address: str
    name: str


@dataclass
class PeerOptions:
    """Plain data, sent from the controller once per keeper."""

    token: str = ""
    tls_ca: str | None = None  # PEM file paths on the sidecars' hosts (mutual TLS)
    tls_cert: str | None = None
    tls_key: str | None = None
    heartbeat_seconds: float = 1.0
    lease_seconds: float = 30.0
    connect_timeout: float = 10.0
    bandwidth: float = 0.0  # bytes per second a keeper sends at most (0: no cap)
    nice: int = 5  # scheduling priority of the replicating thread (0: as the sidecar)


def hold(held: bool = True) -> None:
    """Fault injection (runs in the sidecar): while held, this sidecar's keepers send no chunk
    to their peers (a replication stays in flight); `hold(False)` lets them go on. A held
    replication still stops once its snapshot was dropped or failed."""
    if held:
        _RELEASED.clear()
    else:
        _RELEASED.set()


def lower_priority(nice: int) -> None:
    """The calling thread yields the CPU to training (replication is background work)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        pass


def send_chunks(
    keeper: Any,
    step: int,
    attempt: str,
    source: int,
    items: list[tuple[int, Any, np.ndarray]],
    check: Callable[[], None] = lambda: None,
    bandwidth: float = 0.0,
) -> int:
    """Sends `items` (leaf, bounds, array) of `step` to `keeper` as chunks, `WINDOW` calls in
    flight, small pieces several to a call (`receive_many`); returns the bytes sent. `check()`
    raises to stop; `bandwidth` (bytes/s) caps the rate. On failure every call in flight has
    ended before the error is raised."""
    in_flight: deque[Any] = deque()
    sent = queued = 0
    started = time.monotonic()
    try:
        for batch in _batches(items):
            while bandwidth > 0 and (ahead := queued / bandwidth - (time.monotonic() - started)) > 0:
                time.sleep(min(ahead, 0.2))  # the bytes sent so far are ahead of the cap
                check()
            while not _RELEASED.wait(0.05):  # held (`hold`)
                check()
            check()
            in_flight.append(keeper.receive_many.submit(step, attempt, source, batch))
            queued += sum(len(part[-1]) for part in batch)
            while len(in_flight) >= WINDOW:
                sent += in_flight.popleft().result()
        while in_flight:
            sent += in_flight.popleft().result()
        return sent
    except BaseException:
        for call in in_flight:
            call.exception()
        raise


def _batches(items: list[tuple[int, Any, np.ndarray]]) -> Iterator[list[tuple[Any, ...]]]:
    """The calls' arguments: parts (leaf, bounds, dtype, shape, offset, bytes) of at most
    CHUNK_BYTES each, consecutive ones together while a call stays under CHUNK_BYTES."""
    batch: list[tuple[Any, ...]] = []
    size = 0
    for leaf, bounds, array in items:
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        for offset in range(0, max(flat.size, 1), CHUNK_BYTES):
            chunk = flat[offset : offset + CHUNK_BYTES].tobytes()
            if batch and (size + len(chunk) > CHUNK_BYTES or len(batch) >= PARTS_PER_CALL):
                yield batch
                batch, size = [], 0
            batch.append((leaf, bounds, array.dtype, array.shape, offset, chunk))
            size += len(chunk)
    if batch:
        yield batch


@dataclass
class _PeerHost:
    """What a remote-object handle needs of its host (`cluster.Host` would import JAX here)."""

    index: int
    connection: Any

    @property
    def name(self) -> str:
        return str(self.connection.session.name)


class PeerLinks:
    """One keeper's connections to its peers' sidecars, opened on first use."""

    def __init__(self, host: int, options: PeerOptions):
        self.host = host
        self.options = options
        self._links: dict[str, Any] = {}  # address -> connection
        self._handles: dict[Target, tuple[Any, Any]] = {}  # the last keeper found: (connection, handle)
        self._lock = threading.Lock()

    def send(
        self,
        target: Target,
        step: int,
        attempt: str,
        items: list[tuple[int, Any, Any]],
        check: Callable[[], None],
    ) -> int:
        """Stores `items` (leaf, bounds, array) of `step` in `target`'s keeper; returns the
        bytes sent. `check()` raises to stop (the snapshot was dropped).

        The handle on the peer's keeper is kept from one snapshot to the next: finding it is a
        round trip, as long as the sending itself under load. A keeper replaced since under
        its name (it expired, and a later `Snapshots` made it anew) refuses every chunk sent
        to the old one, so the chunks go once more, to the keeper found now."""
        if not items:
            return 0
        args = (step, attempt, self.host, items, check, self.options.bandwidth)
        peer = self._keeper(target, cached=True)  # a keeper not found at all raises here, once
        try:
            return send_chunks(peer, *args)
        except ObjectNotFoundError:
            return send_chunks(self._keeper(target), *args)

    def _keeper(self, target: Target, cached: bool = False) -> Any:
        """A handle on the peer's keeper, over a live gRPC session with its sidecar: found
        now, or (`cached`) the one found last over the same session."""
        from colocar.controller_bridge.connection import HostConnection
        from colocar.controller_bridge.remote import find_detached

        with self._lock:
            conn = self._links.get(target.address)
            if conn is not None and (conn.session.lost is not None or conn.session.closed):
                conn.close()
                conn = None
            if conn is None:
                o = self.options
                conn = HostConnection(
                    target.address,
                    f"host{target.host}",
                    o.token,
                    shm=False,
                    lease_seconds=o.lease_seconds,
                    heartbeat_seconds=o.heartbeat_seconds,
                    connect_timeout=o.connect_timeout,
                    credentials=channel_credentials(o.tls_ca, o.tls_cert, o.tls_key),
                )
                self._links[target.address] = conn
            kept = self._handles.get(target) if cached else None
            if kept is not None and kept[0] is conn:
                return kept[1]
        found = find_detached(_PeerHost(target.host, conn), target.name)  # type: ignore[arg-type]
        with self._lock:
            self._handles[target] = (conn, found)
        return found

    def close(self) -> None:
        with self._lock:
            links, self._links = self._links, {}
            self._handles.clear()
        for conn in links.values():
            try:
                conn.close()
            except Exception:
                pass
