"""Sidecar-to-sidecar bulk transfer of snapshot replicas (runs in the sidecar).

A keeper sends its blocks to a peer host's keeper directly, never through the controller: it
opens a session with the peer's sidecar like a controller would (the cluster's token, or
mutual TLS), always over gRPC (`shm=False`, even when both sidecars share a machine, so the
path is the one that runs across hosts), and calls the peer keeper's `store` with groups of at
most `group_bytes`; each array of a group travels as 1 MiB chunks of an `Upload` stream (gRPC
flow control), one group at a time. The sending thread runs at a lower priority than
training, and `bandwidth` (bytes/s, 0: unlimited) caps its rate.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

GROUP_BYTES = 16 << 20
MIN_GROUP_BYTES = 64 << 10


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
    connect_timeout: float = 30.0
    group_bytes: int = GROUP_BYTES
    bandwidth: float = 0.0  # bytes per second a keeper sends at most (0: no cap)
    nice: int = 5  # scheduling priority of the replicating thread (0: as the sidecar)


def lower_priority(nice: int) -> None:
    """The calling thread yields the CPU to training (replication is background work)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        pass


def _credentials(options: PeerOptions) -> Any:
    if not (options.tls_ca or options.tls_cert):
        return None
    import grpc

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()

    return grpc.ssl_channel_credentials(read(options.tls_ca), read(options.tls_key), read(options.tls_cert))


def groups(items: list[tuple[int, Any, Any]], limit: int) -> list[list[tuple[int, Any, Any]]]:
    """Consecutive items of at most `limit` bytes (or one larger item)."""
    out: list[list[tuple[int, Any, Any]]] = []
    size = 0
    for item in items:
        nbytes = int(item[2].nbytes)
        if not out or (size + nbytes > limit and out[-1]):
            out.append([])
            size = 0
        out[-1].append(item)
        size += nbytes
    return out


class PeerLinks:
    """One keeper's connections to its peers' sidecars, opened on first use."""

    def __init__(self, host: int, options: PeerOptions):
        self.host = host
        self.options = options
        self._links: dict[str, Any] = {}
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
        bytes sent. `check()` raises to stop between groups (the snapshot was dropped)."""
        peer = self._keeper(target)
        sent = 0
        started = time.monotonic()
        limit = self.options.group_bytes
        if self.options.bandwidth > 0:  # groups of at most ~1/4 s at the cap: an even rate
            limit = max(MIN_GROUP_BYTES, min(limit, int(self.options.bandwidth / 4)))
        for group in groups(items, limit):
            check()
            sent += peer.store(step, attempt, self.host, group)
            self._pace(sent, started, check)
        return sent

    def _pace(self, sent: int, started: float, check: Callable[[], None]) -> None:
        """Sleeps while the bytes sent so far are ahead of the bandwidth cap."""
        if self.options.bandwidth <= 0:
            return
        while (ahead := sent / self.options.bandwidth - (time.monotonic() - started)) > 0:
            time.sleep(min(ahead, 0.2))
            check()

    def _keeper(self, target: Target) -> Any:
        """A handle on the peer's keeper, over a live gRPC session with its sidecar."""
        from colocar.controller_bridge.cluster import Host
        from colocar.controller_bridge.connection import HostConnection

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
                    credentials=_credentials(o),
                )
                self._links[target.address] = conn
        return Host(target.host, conn, []).object(target.name)

    def close(self) -> None:
        with self._lock:
            links, self._links = self._links, {}
        for conn in links.values():
            try:
                conn.close()
            except Exception:
                pass
