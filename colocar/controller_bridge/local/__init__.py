"""Local clusters: sidecar processes on loopback that this controller starts and owns (controller).

`start.local_cluster` starts them (or reattaches to a persistent named one, `reattach`),
`owned` stops them with the cluster, `sidecars` is one process with its ready pipe and files,
`exits` marks a host lost the moment its process ends, `records` keeps what a later controller
(and `colocar sessions`, `colocar clean`) needs to find them again. Names are imported lazily:
`records` imports no JAX, for the command line.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .owned import ClusterDroppedWarning, LocalCluster
    from .start import local_cluster

_WHERE = {"ClusterDroppedWarning": "owned", "LocalCluster": "owned", "local_cluster": "start"}
__all__ = ["ClusterDroppedWarning", "LocalCluster", "local_cluster"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
