"""The controller side: finding sidecars, `@colocated`, `colocated_class`, arrays in and out.

Everything here runs in the controller (the training script, which is also the device owner
in the local and multi-controller topologies). Names are imported lazily: a sidecar that opens
a connection to a peer (`colocar.elastic.peers`) imports `connection` without JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cluster import Cluster, Host, connect
    from .func import ColocatedFunction, colocated
    from .local import local_cluster
    from .obj import ColocatedClass, colocated_class
    from .remote import RemoteObject

_WHERE = {
    "Cluster": "cluster",
    "Host": "cluster",
    "connect": "cluster",
    "ColocatedFunction": "func",
    "colocated": "func",
    "local_cluster": "local",
    "ColocatedClass": "obj",
    "colocated_class": "obj",
    "RemoteObject": "remote",
}

__all__ = [
    "Cluster",
    "ColocatedClass",
    "ColocatedFunction",
    "Host",
    "RemoteObject",
    "colocated",
    "colocated_class",
    "connect",
    "local_cluster",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
