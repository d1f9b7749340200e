"""`local_cluster`: N sidecar processes on loopback, each standing for one host.

Runs in the controller, which owns every local device and plays device owner for all simulated
hosts. Used by the demo, the tests and the benchmarks; the same code runs against real hosts
through `connect(...)`. A token is generated and kept in a 0600 file; sidecars exit when the
controller dies (unless `persist=True`), and `close()` removes their arenas even if they were
killed (`owned`). A persistent, named cluster is found again by a later controller (`reattach`).
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax

from colocar.protocol.tokens import new_token, write_token_file
from colocar.sizes import parse_size

from ..cluster import Host, session_name, split_devices
from ..connection import HostConnection
from ..session import SessionName
from . import records
from .owned import LocalCluster, Sidecars, owned_cluster
from .reattach import reattach
from .sidecars import Sidecar, wait_ready

MiB = 1 << 20


def _workdir_with_token() -> tuple[str, str, str]:
    """A fresh work folder holding a new token in its 0600 file: (folder, token, file). The
    folders and records that killed controllers (restarted kernels) left go first."""
    for record in records.left_over():
        records.remove_left_over(record)
    workdir = tempfile.mkdtemp(prefix="colocar-")
    token = new_token()
    token_file = os.path.join(workdir, "token")
    write_token_file(token_file, token)
    return workdir, token, token_file


def _sidecar_argv(
    shm_dir: str,
    token_file: str,
    pools: dict[str, int] | None,
    persist: bool,
    *,
    arena_size: int,
    lease_seconds: float,
    processes: int,
    threads: int,
    alloc_timeout: float,
) -> list[str]:
    """The command line every sidecar of a local cluster shares (each adds its ready pipe and
    label); without `persist`, the sidecars exit when this process dies (`--parent-pid`)."""
    argv = [
        sys.executable,
        "-m",
        "colocar.sidecar",
        "--address",
        "127.0.0.1:0",
        "--shm-dir",
        shm_dir,
        "--arena-size",
        str(arena_size),
        "--token-file",
        token_file,
        "--lease-seconds",
        str(lease_seconds),
        "--processes",
        str(processes),
        "--threads",
        str(threads),
        "--alloc-timeout",
        str(alloc_timeout),
    ]
    for name, size in (pools or {}).items():
        argv += ["--pool", f"{name}={size}"]
    if not persist:
        argv += ["--parent-pid", str(os.getpid())]
    return argv


def _sidecar_env(env: dict[str, str] | None) -> dict[str, str]:
    """This process's environment plus `env`, with the folder holding this `colocar` package
    first on PYTHONPATH, so the sidecars import the same copy."""
    here = os.path.abspath(__file__)
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(here))))
    child_env = {**os.environ, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, child_env.get("PYTHONPATH", "")) if p)
    return child_env


def connect_sidecars(
    sidecars: list[Sidecar],
    groups: list[list[Any]],
    token: str,
    *,
    startup_timeout: float,
    shm: bool,
    lease_seconds: float,
    heartbeat_seconds: float,
    alloc_timeout: float,
    named: SessionName,
) -> list[Host]:
    """Waits for the sidecars to be ready, then connects to all at once (sidecar i gets device
    group i); on a failure, closes the connections that were made and raises the first.
    `named`: the session's name and grace."""
    options = dict(shm=shm, lease_seconds=lease_seconds, heartbeat_seconds=heartbeat_seconds, named=named)

    def connect(s: Sidecar, group: list[Any]) -> Host:
        assert s.info is not None
        conn = HostConnection(
            s.info["address"],
            f"host{s.index}",
            token,
            alloc_timeout=alloc_timeout,
            process_status=s.status,
            **options,  # type: ignore[arg-type]
        )
        return Host(s.index, conn, group)

    wait_ready(sidecars, startup_timeout)
    # All at once: each connection's session, link and arena mapping take a few round trips.
    with ThreadPoolExecutor(len(sidecars), thread_name_prefix="colocar-connect") as pool:
        futures = [pool.submit(connect, s, group) for s, group in zip(sidecars, groups, strict=True)]
        outcomes = [f.exception() or f.result() for f in futures]
    connected = [o for o in outcomes if isinstance(o, Host)]
    failures = [o for o in outcomes if isinstance(o, BaseException)]
    if failures:
        for host in connected:
            host.connection.close()
        raise failures[0]
    return connected


def local_cluster(
    hosts: int = 2,
    *,
    devices: Sequence[Any] | None = None,
    arena_size: int = 256 * MiB,
    pools: dict[str, int] | None = None,
    shm_dir: str | None = None,
    shm: bool = True,
    lease_seconds: float = 30.0,
    heartbeat_seconds: float = 1.0,
    processes: int = 2,
    threads: int = 32,
    persist: bool = False,
    startup_timeout: float = 120.0,
    env: dict[str, str] | None = None,
    alloc_timeout: float = 30.0,
    session: str | None = None,
    grace_seconds: float | None = None,
) -> LocalCluster:
    """Starts `hosts` sidecars on loopback and connects to them.

    `devices` (default: all local JAX devices) are split into equal contiguous groups, one per
    host. `shm_dir` defaults to `COLOCAR_SHM_DIR` or /dev/shm. `shm=False` makes the controller
    move bulk data through gRPC streams as it would for remote sidecars. With `persist=True`
    the sidecars outlive this process; `cluster.token_file` and the host addresses let a later
    process `connect(...)` to them. `alloc_timeout` is how long an arena allocation (on either
    side) waits for room in a full pool before it fails. `session` and `grace_seconds` name the
    controller's session as in `connect`; with `persist=True` too, the same call in a later
    process (a restarted kernel) reattaches to the sidecars still running under that name
    instead of starting new ones (`cluster.shutdown()` stops them).
    """
    named = session_name(session, grace_seconds)
    groups = split_devices(devices if devices is not None else jax.local_devices(), hosts)
    connect = functools.partial(
        connect_sidecars,
        startup_timeout=startup_timeout,
        shm=shm,
        lease_seconds=lease_seconds,
        heartbeat_seconds=heartbeat_seconds,
        alloc_timeout=alloc_timeout,
        named=named,
    )
    if persist and named.name and (found := reattach(named.name, groups, connect, _sidecar_env(env))):
        return found
    workdir, token, token_file = _workdir_with_token()
    argv = _sidecar_argv(
        shm_dir or os.environ.get("COLOCAR_SHM_DIR", "/dev/shm"),
        token_file,
        pools,
        persist,
        arena_size=arena_size,
        lease_seconds=lease_seconds,
        processes=processes,
        threads=threads,
        alloc_timeout=alloc_timeout,
    )
    recorded = named.name if persist else ""  # a persistent named cluster is found again
    spawn = Sidecars([], argv, _sidecar_env(env), workdir, persist, recorded, parse_size(str(arena_size)))
    return _start(hosts, groups, token, spawn, connect)


def _start(
    hosts: int,
    groups: list[list[Any]],
    token: str,
    spawn: Sidecars,
    connect: Callable[[list[Sidecar], list[list[Any]], str], list[Host]],
) -> LocalCluster:
    """Starts the sidecars of `spawn` and connects to them; a failed start leaves nothing
    running. Its record (`records.save`) is written with their pids first, then complete."""
    spawn.sidecars = [Sidecar(i, spawn.workdir).spawn(spawn.argv, spawn.env) for i in range(hosts)]
    try:
        spawn.save()  # the pids first: a controller killed while they start leaves a record
        connected = connect(spawn.sidecars, groups, token)
        spawn.save()
    except BaseException:
        spawn.stop(persist=False)
        raise
    return owned_cluster(connected, spawn)
