"""A single controller drives every host (runs in the controller).

`SingleController`: this process drives every host; a lost host is recovered in-process (the
run function is called again on the survivors) and hosts that come back rejoin.
"""

from __future__ import annotations

from typing import Any

from colocar.controller_bridge.cluster import Cluster, Host

from ..policy.events import Events
from ..policy.survivors import wait_for_loss
from ..policy.tiers import SnapshotTier


class SingleController:
    """One controller drives every host: losses are recovered in-process, hosts rejoin."""

    multi, rejoins = False, True

    def devices(self, cluster: Cluster) -> list[Any]:
        return list(cluster.devices)

    def live(self, root: Cluster, alive: list[Host]) -> int:
        """How many hosts count against `min_hosts`."""
        return len(alive)

    def snapshot_tier(self, given: Any, replicas: int, cluster: Cluster, name: str | None) -> SnapshotTier:
        return SnapshotTier(given, replicas)

    def lost(
        self, cluster: Cluster, error: BaseException, timeout: float | None, events: Events
    ) -> list[Host]:
        """The hosts `error` came from the loss of ([]: not a loss, it propagates)."""
        return wait_for_loss(cluster, error, timeout)

    def agreed(self, value: int | None, what: str) -> int | None:
        return value

    def first_error(self, error: str, what: str) -> str:
        return error


__all__ = ["SingleController"]
