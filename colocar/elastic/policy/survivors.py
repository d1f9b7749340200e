"""Which hosts are alive, and a cluster over the survivors (runs in the controller).

A host is lost when its session says so (`session.lost`: its sidecar died, stopped answering
or became unreachable). After a loss the elastic manager works on a `ClusterView`: a `Cluster`
over the surviving hosts that shares their connections with the parent cluster and closes
none of them. Its hosts are numbered 0..n-1 again (the loaders and checkpoints index hosts by
position), keeping their names ("host2" stays "host2").
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from colocar.controller_bridge.cluster import Cluster, Host
from colocar.errors import ColocarError


class ElasticError(ColocarError):
    """The elastic manager cannot go on: too few hosts left, or nothing it can resume from."""


class ClusterView(Cluster):
    """The surviving hosts of `parent`, renumbered; closing it closes no connection.

    Array calls on its devices go through it (it is made current when created), so a
    colocated call, a loader or a checkpoint manager built on it sees only the survivors.
    """

    def __init__(self, parent: Cluster, hosts: Sequence[Host]):
        self.parent = parent
        super().__init__([Host(i, h.connection, h.devices) for i, h in enumerate(hosts)])

    def close(self) -> None:
        """Stops routing calls through this view; the parent keeps the connections."""
        self.detach()

    def __repr__(self) -> str:
        return f"ClusterView({[h.name for h in self.hosts]} of {len(self.parent.hosts)} hosts)"


def lost_hosts(cluster: Cluster) -> list[Host]:
    """The hosts of `cluster` whose session is lost."""
    return [h for h in cluster.hosts if h.connection.session.lost is not None]


def alive_hosts(cluster: Cluster) -> list[Host]:
    """The hosts of `cluster` whose session is not lost (nor closed)."""
    return [h for h in cluster.hosts if h.connection.session.lost is None and not h.connection.session.closed]


def looks_like_loss(error: BaseException) -> bool:
    """Whether `error` may come from a lost host: a `HostLostError`, or another of colocar's
    errors that a loss can cause (a failed save, a loader's `PipelineError`, a call timeout),
    itself or as the cause of `error`. Errors about the user's own code or values (a remote
    exception, a bad argument or config) and every other exception never count, so they are
    never masked."""
    from colocar.errors import ArrayLayoutError, AuthError, RemoteError, SerializationError, VersionSkewError
    from colocar.loaders.errors import PipelineError

    theirs = (RemoteError, SerializationError, ArrayLayoutError, AuthError, VersionSkewError, ElasticError)
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ColocarError | PipelineError) and not isinstance(current, theirs):
            return True
        current = current.__cause__ or current.__context__
    return False


def loss_grace(cluster: Cluster) -> float:
    """How long a host's loss can take to be marked after an error shows it: a keepalive's
    deadline (at least 2 s, three heartbeats) plus a heartbeat, plus a margin."""
    heartbeat = max((h.connection.session.heartbeat_seconds for h in cluster.hosts), default=1.0)
    return max(2.0, 3 * heartbeat) + heartbeat + 3.0


def wait_for_loss(cluster: Cluster, error: BaseException, timeout: float | None) -> list[Host]:
    """The hosts of `cluster` lost, once `error` looks like a loss; [] otherwise.

    An error can reach the caller (a closed link, a failed write) a little before the host's
    keepalive marks it lost: waits up to `timeout` seconds (default `loss_grace`) for the
    mark, and only for errors that look like a loss."""
    if not looks_like_loss(error):
        return []
    deadline = time.monotonic() + (loss_grace(cluster) if timeout is None else timeout)
    while True:
        lost = lost_hosts(cluster)
        if lost or time.monotonic() > deadline:
            return lost
        time.sleep(0.05)


def host_named(cluster: Cluster, host: int | str) -> Host:
    """A host of `cluster` by its index in it or by its name ("host1")."""
    for h in cluster.hosts:
        if h.name == host or (isinstance(host, int) and h.index == host):
            return h
    raise ColocarError(f"no host {host!r} in {[h.name for h in cluster.hosts]}")


__all__ = [
    "ClusterView",
    "ElasticError",
    "alive_hosts",
    "host_named",
    "looks_like_loss",
    "lost_hosts",
    "wait_for_loss",
]
