"""colocar: a colocated-Python runtime for JAX.

A sidecar process on every accelerator host runs Python shipped from the controller with
`@colocated`; bulk data moves through a shared-memory arena on the same host, never through
the controller. Public API:

    local_cluster(hosts=N)      N sidecars on loopback (demo, tests, benchmarks)
    connect(addresses, token=)  running sidecars (or COLOCAR_SIDECARS)
    colocated / colocated_class ship functions and classes
    shm.empty(shape, dtype)     allocate a result in the arena (no copy on return)

Names are imported lazily, so `python -m colocar.sidecar` does not import JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    ArrayLayoutError,
    AuthError,
    CallTimeoutError,
    CheckpointError,
    ColocarError,
    HostLostError,
    ObjectNotFoundError,
    PoolFullError,
    ProcessesDisagree,
    ProcessLostError,
    QuotaExceededError,
    RemoteError,
    SerializationError,
    SessionEndedError,
    SnapshotError,
    VersionSkewError,
)

if TYPE_CHECKING:
    from . import checkpoint, elastic, loaders, shm
    from .controller_bridge import (
        Cluster,
        ColocatedClass,
        ColocatedFunction,
        Host,
        RemoteObject,
        colocated,
        colocated_class,
        connect,
        local_cluster,
    )

_LAZY = {
    "Cluster",
    "ColocatedClass",
    "ColocatedFunction",
    "Host",
    "RemoteObject",
    "colocated",
    "colocated_class",
    "connect",
    "local_cluster",
}

__all__ = [
    "ArrayLayoutError",
    "AuthError",
    "CallTimeoutError",
    "CheckpointError",
    "Cluster",
    "ColocarError",
    "ColocatedClass",
    "ColocatedFunction",
    "Host",
    "HostLostError",
    "ObjectNotFoundError",
    "PoolFullError",
    "ProcessesDisagree",
    "ProcessLostError",
    "QuotaExceededError",
    "RemoteError",
    "RemoteObject",
    "SerializationError",
    "SessionEndedError",
    "SnapshotError",
    "VersionSkewError",
    "colocated",
    "colocated_class",
    "connect",
    "checkpoint",
    "elastic",
    "loaders",
    "local_cluster",
    "shm",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import controller_bridge

        return getattr(controller_bridge, name)
    if name in ("shm", "loaders", "checkpoint", "elastic"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'colocar' has no attribute {name!r}")
