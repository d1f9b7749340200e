"""Hosts, clusters and finding sidecars: `connect(...)` and the `COLOCAR_SIDECARS` variable.

Runs in the controller. A `Host` is one sidecar plus the JAX devices it stands next to; a
`Cluster` is the hosts of a job, in host-major device order. Active clusters are registered so
that a colocated call can find the host of each device its array arguments live on.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from colocar import jax_compat
from colocar.errors import ColocarError, ObjectNotFoundError
from colocar.protocol.tls import channel_credentials

from .addresses import sidecar_addresses, token_from_env
from .connection import HostConnection
from .remote import RemoteObject, find_detached
from .session import UNNAMED, SessionName

# Open clusters, oldest first, held weakly: a cluster nobody holds can be collected (and a local
# one then shuts its sidecars down). Read with `_open_clusters()`.
_active: list[weakref.ref[Cluster]] = []
_active_lock = threading.Lock()


def _open_clusters() -> list[Cluster]:
    """The open clusters still referenced, oldest first (the caller holds `_active_lock`)."""
    _active[:] = [r for r in _active if r() is not None]
    return [c for c in (r() for r in _active) if c is not None]


class Host:
    """One sidecar and the devices of its host."""

    def __init__(self, index: int, connection: HostConnection, devices: Sequence[Any]):
        self.index = index
        self.connection = connection
        self.devices = list(devices)

    @property
    def name(self) -> str:
        return self.connection.session.name

    @property
    def address(self) -> str:
        return self.connection.session.address

    @property
    def shm(self) -> bool:
        """True when this controller maps the host's arena (bulk data skips gRPC)."""
        return self.connection.blocks.mapped

    def stats(self) -> dict[str, Any]:
        """The sidecar's counters: calls, errors, latency, sessions, objects, arena per pool."""
        reply = self.connection.stats()
        values: dict[str, Any] = {f.name: getattr(reply, f.name) for f in reply.DESCRIPTOR.fields}
        values["pools"] = {
            p.name: {f.name: getattr(p, f.name) for f in p.DESCRIPTOR.fields if f.name != "name"}
            for p in reply.pools
        }
        return values

    def object(self, name: str) -> RemoteObject:
        """A handle on the object `name` living on this host: this session's (a named one's),
        else a detached one (see `colocated_class`)."""
        return find_detached(self, name)

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address}, devices={[d.id for d in self.devices]})"


class Cluster:
    """The sidecars of a job; a context manager that closes them."""

    def __init__(self, hosts: list[Host], on_close: Callable[[], None] | None = None):
        self.hosts = hosts
        self._on_close = on_close
        self.admission: dict[str, Any] | None = None  # how a shared pool admitted this job
        self._closed = False
        self._device_hosts = {d: h for h in hosts for d in h.devices}
        with _active_lock:
            _active.append(weakref.ref(self))

    @property
    def devices(self) -> list[Any]:
        """All devices, host-major."""
        return [d for h in self.hosts for d in h.devices]

    @property
    def session(self) -> str:
        """The name of this controller's session on the sidecars ("" when unnamed)."""
        return self.hosts[0].connection.session.session_name if self.hosts else ""

    @property
    def took_over(self) -> dict[str, str]:
        """Per host, the controller ("hostname:pid") whose session of the same name this one
        took over at connect (a controller that died, or an earlier connection of this one)."""
        return {h.name: h.connection.session.took_over for h in self.hosts if h.connection.session.took_over}

    def object(self, name: str) -> RemoteObject:
        """A handle on the named object `name` on whichever host holds it: this session's own
        (made with `Cls.on(host, name=...)` in a named session, also by a controller whose
        session this one took over), else a detached one. Raises `ColocarError` when no host
        or more than one holds such an object (then ask the host: `cluster.host(i).object`)."""
        found = []
        for host in self.hosts:
            try:
                found.append(host.object(name))
            except ObjectNotFoundError:
                pass
        if len(found) == 1:
            return found[0]
        if not found:
            raise ObjectNotFoundError(
                f"no host of this cluster ({[h.name for h in self.hosts]}) holds an object named {name!r}"
            )
        holders = [repr(handle) for handle in found]
        raise ColocarError(
            f"{len(found)} hosts hold an object named {name!r} ({holders}): ask one, "
            f"cluster.host(i).object({name!r})"
        )

    def stats(self) -> dict[str, Any]:
        """Every host's counters (`Host.stats`) and, in a shared pool, how this job was
        admitted (its tenant, the queue positions and estimated waits it saw, the wait)."""
        return {"hosts": [h.stats() for h in self.hosts], "pool": self.admission}

    def host_of(self, device: Any) -> Host | None:
        return self._device_hosts.get(device)

    def host(self, key: int | str) -> Host:
        """The host with this index or name."""
        found = next((h for h in self.hosts if key in (h.name, h.index)), None)
        if found is None:
            raise ColocarError(f"no host {key!r} in {[h.name for h in self.hosts]}")
        return found

    def replace_host(self, host: int | str, address: str, *, timeout: float = 30.0) -> Host:
        """Points a lost host (its index or name) at a replacement sidecar on `address`, such
        as a new machine that took the lost one's place: the host keeps its name, index and
        devices, with a new connection and session (its old remote objects are gone).
        `colocar.elastic` then scales back up onto it at the next step boundary, refilling
        its arena from its peers. Raises `ColocarError` while the host is not lost (a live
        sidecar is never dropped), and `HostLostError` if nothing answers on `address` within
        `timeout` seconds (the host then stays lost, as it was)."""
        target = self.host(host)
        old = target.connection
        if old.session.lost is None:
            raise ColocarError(f"{target.name} ({target.address}) is not lost: only a lost host is replaced")
        target.connection = old.replacement(address, connect_timeout=timeout)
        old.close()  # lost already: ends its threads, calls nobody
        return target

    def mesh(self, axis_names: str | Sequence[str], shape: Sequence[int] | None = None) -> jax.sharding.Mesh:
        """A mesh over the cluster's devices in host-major order.

        With one axis the shape defaults to all devices; with two, to (hosts, devices per host).
        """
        names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
        devices = self.devices
        if shape is None:
            if len(names) == 1:
                shape = (len(devices),)
            elif len(names) == 2 and len({len(h.devices) for h in self.hosts}) == 1:
                shape = (len(self.hosts), len(self.hosts[0].devices))
            else:
                raise ValueError(f"give the shape of a mesh with axes {names}")
        shape = tuple(shape)
        if int(np.prod(shape)) != len(devices) or len(shape) != len(names):
            raise ValueError(f"mesh shape {shape} does not fit {len(devices)} devices and axes {names}")
        return jax.sharding.Mesh(np.array(devices, dtype=object).reshape(shape), names)

    def make_current(self) -> Cluster:
        """Routes array calls on devices this cluster shares with others to this one.

        A colocated call finds the host of each device in the most recently created (or made
        current) open cluster that has the device.
        """
        with _active_lock:
            if weakref.ref(self) in _active:
                _active.remove(weakref.ref(self))
                _active.append(weakref.ref(self))
        return self

    def detach(self) -> None:
        """Stops routing calls through this cluster; its hosts' connections stay open (a view
        over some of another cluster's hosts closes this way)."""
        self._closed = True
        with _active_lock:
            if weakref.ref(self) in _active:
                _active.remove(weakref.ref(self))

    def close(self) -> None:
        """Ends the sessions (freeing remote objects and blocks) and stops owned sidecars.
        Arrays the program still holds stay valid: their blocks are kept until they are gone."""
        if self._closed:
            return
        self.detach()
        jax_compat.release_deferred()()  # JAX lets go of dropped arrays' views: their blocks go now
        for host in self.hosts:
            host.connection.close()
        if self._on_close is not None:
            self._on_close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Cluster({self.hosts})"


def current_cluster() -> Cluster:
    """The most recently created (or made current) open cluster."""
    with _active_lock:
        clusters = _open_clusters()
    if clusters:
        return clusters[-1]
    raise ColocarError(
        "no open colocar cluster: open one with colocar.local_cluster(...) or colocar.connect(...), "
        "or pass it explicitly"
    )


def where() -> str:
    """This controller among the JAX processes, for messages: "JAX process 1 of 2"."""
    return f"JAX process {jax.process_index()} of {jax.process_count()}"


def addressable(devices: Iterable[Any]) -> list[Any]:
    """The devices this JAX process owns (all of them with one controller), in their order.
    Under multi-controller JAX a global array also lies on other processes' devices; this
    process reaches only its own, through its own sidecars."""
    process = jax.process_index()
    return [d for d in devices if d.process_index == process]


def host_of_device(device: Any) -> Host:
    """The host (of the most recently opened active cluster, its session not closed) that a
    device belongs to."""
    with _active_lock:
        clusters = _open_clusters()
    for cluster in reversed(clusters):
        host = cluster.host_of(device)
        if host is not None and not host.connection.session.closed:
            return host  # a closed one (a view left over a closed cluster) never routes a call
    if not clusters:
        raise ColocarError(
            f"device {device} belongs to no open colocar cluster: open one with "
            "colocar.local_cluster(...) or colocar.connect(...) first"
        )
    covered = {h.name: [d.id for d in h.devices] for c in clusters for h in c.hosts}
    raise ColocarError(
        f"device {device.id} of {where()} belongs to no host of this process's open colocar "
        f"clusters (their hosts and devices: {covered}); connect this process to the sidecar of "
        "the host it is on (colocar.connect([...], devices=...))"
    )


def check_reachable(host: Any) -> None:
    """Raises unless `host` is a `Host` whose connection this process holds open: a process
    calls only the sidecars it connected to (under multi-controller JAX, each process its own)."""
    if not isinstance(host, Host):
        raise TypeError(
            f"on() takes Host objects of this process's clusters (cluster.hosts[i]), not "
            f"{type(host).__name__} {host!r}"
        )
    if host.connection.session.closed:
        with _active_lock:
            names = [h.name for c in _open_clusters() for h in c.hosts if not h.connection.session.closed]
        raise ColocarError(
            f"{host.name} ({host.address}) is not reachable from {where()}: its cluster was closed "
            f"(this process's open hosts: {names}); call hosts of an open cluster, or "
            "colocar.connect(...) to it again"
        )


def split_devices(devices: Sequence[Any], hosts: int) -> list[list[Any]]:
    """Contiguous, equal groups of devices, one per host."""
    devices = list(devices)
    if hosts < 1 or len(devices) % hosts:
        raise ValueError(
            f"cannot split {len(devices)} devices evenly among {hosts} hosts; pass devices=... "
            "or set XLA_FLAGS=--xla_force_host_platform_device_count=N on CPU"
        )
    per = len(devices) // hosts
    return [devices[i * per : (i + 1) * per] for i in range(hosts)]


SESSION_NAME = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.:@-]{0,127}$")


def session_name(session: str | None, grace_seconds: float | None) -> SessionName:
    """A session's name and grace, checked: a name of up to 128 letters, digits and `_.:@-`,
    starting with a letter, a digit, `_` or `.`."""
    if session is None:
        if grace_seconds is not None:
            raise ValueError("grace_seconds applies to a named session: pass session= too")
        return UNNAMED
    if not isinstance(session, str) or not SESSION_NAME.match(session):
        raise ValueError(
            f"session name {session!r}: use up to 128 letters, digits and '_.:@-' (e.g. 'exp1', 'alice@nb')"
        )
    if grace_seconds is not None and grace_seconds <= 0:
        raise ValueError(f"grace_seconds must be positive, not {grace_seconds}")
    return SessionName(session, grace_seconds or 0.0)


def connect(
    addresses: str | Sequence[str] | None = None,
    *,
    token: str | None = None,
    token_file: str | None = None,
    devices: Sequence[Sequence[Any]] | None = None,
    shm: bool = True,
    lease_seconds: float = 0.0,
    heartbeat_seconds: float = 1.0,
    connect_timeout: float = 30.0,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    session: str | None = None,
    grace_seconds: float | None = None,
    pool: str | None = None,
    wait: bool = True,
    queue_timeout: float = 0.0,
) -> Cluster:
    """Connects to running sidecars.

    `addresses` defaults to the comma-separated `COLOCAR_SIDECARS`; the token to `COLOCAR_TOKEN`
    or the file named by `COLOCAR_TOKEN_FILE`. `devices` gives each host its devices; by default
    one address gets this process's local devices (multi-controller JAX: one sidecar per
    process), several split them evenly. `shm=False` forces bulk data through gRPC streams.
    `lease_seconds=0` takes the sidecar's own lease (`--lease-seconds`).

    `session` names this controller's session on every sidecar: it then outlives the
    controller for `grace_seconds` (default: the sidecar's `--session-grace`, one hour), and a
    controller connecting later under the same name and token takes it over, with its named
    objects (`cluster.object(name)`); what else the old one held is freed. Without a name a
    session ends with its controller (its lease, `lease_seconds`).

    `pool` (a pool file of `colocar pool up`, or its agent's host:port) joins a shared pool as
    the token's tenant, on sidecars of its own (in multi-controller JAX, each process on the
    one on its machine). A full pool queues it (position and wait
    printed, and in `cluster.stats()["pool"]`); PoolFullError without `wait` or after
    `queue_timeout` s."""
    secret = token_from_env(token, token_file)
    admitted = None
    if pool is not None:
        from .pool_client import admit

        admitted = admit(pool, secret or "", wait=wait, queue_timeout=queue_timeout)
        addresses = admitted.own(jax.process_index(), jax.process_count())
    addresses = sidecar_addresses(addresses)
    groups = [list(g) for g in devices] if devices else split_devices(jax.local_devices(), len(addresses))
    options = dict(
        shm=shm,
        lease_seconds=lease_seconds,
        heartbeat_seconds=heartbeat_seconds,
        connect_timeout=connect_timeout,
        credentials=channel_credentials(tls_ca, tls_cert, tls_key),
        named=session_name(session, grace_seconds),
    )
    cluster = Cluster(_hosts(addresses, secret, groups, options))
    cluster.admission = admitted.as_dict() if admitted is not None else None
    return cluster


def _hosts(addresses: list[str], secret: str | None, groups: list[list[Any]], options: dict) -> list[Host]:
    """A connected host per address (device group i to address i); none left open on a failure."""
    hosts: list[Host] = []
    try:
        for i, address in enumerate(addresses):
            conn = HostConnection(address, f"host{i}", secret, **options)
            hosts.append(Host(i, conn, groups[i]))
    except BaseException:
        for host in hosts:
            host.connection.close()
        raise
    return hosts
