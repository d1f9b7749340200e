"""Elastic training: keep training when hosts are lost, from the newest state that survived.

`Manager(cluster, checkpoints=mngr)` runs a training function again on the surviving hosts
after a loss (`@manager.run(min_hosts=...)`), restores the newest snapshot or checkpoint onto
the smaller mesh (`manager.restore`) with the data position in records, and snapshots or saves
when due (`manager.step`). `faults` kills or stops a host's sidecar at a step, for tests and
drills. Runs in the controller; see docs/elastic.md.

The layout: `manager.py` (the `Manager`) and `faults.py` here; `policy/` what the manager
decides from (the surviving hosts, where a state comes back from, the data position, rejoins,
events); `topologies/` what differs between a single controller and one JAX process per host
(strategy objects); `snapshots/` the host-memory snapshot store, with its multi-controller
side in `snapshots/multi/` and the sidecar side (keepers, peer transfer) in
`snapshots/keepers/`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import faults
    from .manager import Manager
    from .policy.data import devices_for_batch
    from .policy.survivors import ClusterView, ElasticError
    from .snapshots import Snapshots

__all__ = ["ClusterView", "ElasticError", "Manager", "Snapshots", "devices_for_batch", "faults"]


def __getattr__(name: str) -> Any:
    import importlib

    if name == "Manager":
        return importlib.import_module(".manager", __name__).Manager
    if name == "Snapshots":
        return importlib.import_module(".snapshots", __name__).Snapshots
    if name in ("ClusterView", "ElasticError"):
        return getattr(importlib.import_module(".policy.survivors", __name__), name)
    if name == "devices_for_batch":
        return importlib.import_module(".policy.data", __name__).devices_for_batch
    if name == "faults":
        return importlib.import_module(".faults", __name__)
    raise AttributeError(f"module 'colocar.elastic' has no attribute {name!r}")
