"""Which host of this process builds which rows of each global batch (runs in the controller).

The rows come from the batch sharding over the *global* mesh (every device of every JAX
process), so each device's rows, and so each host's, are the same whether one controller
drives every host (`local_cluster`) or each JAX process drives its own sidecar
(multi-controller JAX): the sampler numbers rows of the global batch, never of a host. Only
the mesh's devices this process addresses get pipelines, on the hosts of its cluster; the
other processes build the other rows for their own devices.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import NamedSharding

from colocar.controller_bridge.cluster import Cluster, Host
from colocar.errors import ColocarError, HostLostError, SessionEndedError

from .checks import ConfigError, suggest
from .layout import SlotLayout

# (host, its slot layout, each of its devices with the index of the segment it takes)
HostPlan = tuple[Host, SlotLayout, list[tuple[Any, int]]]


def local_groups(cluster: Cluster, mesh: jax.sharding.Mesh) -> list[tuple[Host, list[Any]]]:
    """The mesh's devices this process addresses, grouped by the host of `cluster` they belong
    to (hosts in index order, devices in mesh order). Raises naming the devices and this JAX
    process when the mesh has none of them, or when no connected sidecar covers some."""
    process, processes = jax.process_index(), jax.process_count()
    local = [d for d in mesh.devices.flat if d.process_index == process]
    where = f"JAX process {process} of {processes}"
    if not local:
        raise ColocarError(
            f"the mesh has none of the devices of {where}: each process loads only its own "
            "devices' rows, so build the mesh over every process's devices (jax.devices())"
        )
    by_host: dict[int, list[Any]] = {}  # position in cluster.hosts -> devices (a cluster may be a subset)
    uncovered = []
    for device in local:
        host = cluster.host_of(device)
        if host is None:
            uncovered.append(device)
        else:
            by_host.setdefault(next(i for i, h in enumerate(cluster.hosts) if h is host), []).append(device)
    if uncovered:
        covered = {h.name: [d.id for d in h.devices] for h in cluster.hosts}
        raise ColocarError(
            f"devices {[d.id for d in uncovered]} of the mesh, local to {where}, belong to no "
            f"connected sidecar (this process's hosts and their devices: {covered}); connect this "
            "process to the sidecar of the host they are on (colocar.connect([...], devices=...))"
        )
    return [(cluster.hosts[i], by_host[i]) for i in sorted(by_host)]


def host_plans(
    groups: list[tuple[Host, list[Any]]],
    sharding: NamedSharding,
    global_batch_size: int,
    fields: dict[str, tuple[tuple[int, ...], str]],
) -> list[HostPlan]:
    """Each local host's slot layout: the global rows its devices hold under `sharding` (the
    batch axis' sharding over the global mesh), which must be one contiguous range."""
    B = global_batch_size
    index_map = sharding.devices_indices_map((B,))
    plans = []
    for host, devices in groups:
        ranges = {d: index_map[d][0].indices(B)[:2] for d in devices}
        layout = SlotLayout.build(list(ranges.values()), fields)
        placed = [(d, layout.segments.index(ranges[d])) for d in devices]
        covered = sum(b - a for a, b in layout.segments)
        if covered != layout.rows[1] - layout.rows[0]:
            raise ValueError(
                f"{host.name}'s rows of the batch are not contiguous ({layout.segments}); build the "
                "mesh host-major: cluster.mesh(...) with one controller, jax.devices() in its order "
                "with one JAX process per host"
            )
        plans.append((host, layout, placed))
    return plans


def check_batch_axes(mesh: jax.sharding.Mesh, axes: tuple[str, ...], global_batch_size: int) -> None:
    """Raise `ConfigError` naming the key and the numbers when `batch_axes` names an axis the mesh
    lacks, or when the devices along them do not divide `global_batch_size` (else JAX raises an
    IndivisibleError that names neither)."""
    names = tuple(mesh.axis_names)
    for i, axis in enumerate(axes):
        if axis not in names:
            raise ConfigError(
                f"batch_axes[{i}]" if len(axes) > 1 else "batch_axes",
                f"{axis!r} is not an axis of the mesh; the mesh axes are "
                f"{', '.join(repr(a) for a in names)}{suggest(str(axis), [str(n) for n in names])}",
            )
    sizes = {a: int(mesh.shape[a]) for a in axes}
    shards = math.prod(sizes.values())
    B = global_batch_size
    if B % shards:
        lower, upper = B - B % shards, B - B % shards + shards
        options = f"{lower} or {upper}" if lower else f"{upper}"
        raise ConfigError(
            "global_batch_size",
            f"{B} is not a multiple of {shards}, the number of devices along the batch axes "
            f"{sizes} that split each batch; use {options}, or shard the batch over other axes "
            "(batch_axes)",
        )


RECREATE = (
    "create the loader again on a connected cluster: colocar.loaders.load(config, cluster, mesh, "
    "start=state['next_batch']) with the state of a saved get_state() (or set_state it), so that "
    "the stream goes on from there"
)


def pipelines_gone(plans: list[HostPlan], generations: list[int]) -> ColocarError | None:
    """Why the pipelines of these hosts can no longer be used, or None: a host's session ended
    from elsewhere (taken over, closed), or was replaced (it lapsed past its grace, the sidecar
    restarted) since `generations` were read (each session asks its sidecar first). The error
    says how to re-create the loader; it is of the session's error's kind (`SessionEndedError`,
    or `HostLostError` for a new session)."""
    for (host, _, _), generation in zip(plans, generations, strict=True):
        session = host.connection.session
        session.heartbeat()  # what the sidecar says of the session now (a takeover, say)
        if session.ended is not None:
            return SessionEndedError(
                f"the loader's pipeline on {host.name} is gone ({session.ended}); {RECREATE}"
            )
        if session.generation != generation:
            return HostLostError(
                f"the loader's pipeline on {host.name} is gone: its session there ended (its lease "
                f"or grace ran out, or the sidecar restarted) and a new one began; {RECREATE}"
            )
    return None
