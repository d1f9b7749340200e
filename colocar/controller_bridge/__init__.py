"""The controller side: finding sidecars, `@colocated`, `colocated_class`, arrays in and out.

Everything here runs in the controller (the training script, which is also the device owner
in the local and multi-controller topologies).
"""

from .cluster import Cluster, Host, connect
from .func import ColocatedFunction, colocated
from .local import local_cluster
from .obj import ColocatedClass, colocated_class
from .remote import RemoteObject

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
