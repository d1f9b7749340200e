"""`local_cluster`: N sidecar processes on loopback, each standing for one host.

Runs in the controller, which owns every local device and plays device owner for all simulated
hosts. Used by the demo, the tests and the benchmarks; the same code runs against real hosts
through `connect(...)`. A token is generated and kept in a 0600 file; sidecars exit when the
controller dies (unless `persist=True`), and `close()` removes their arenas even if they were
killed. A cluster nobody holds any more (a notebook cell re-run) shuts its sidecars down too,
with a `ClusterDroppedWarning`.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import tempfile
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax

from colocar.errors import ColocarError
from colocar.protocol.tokens import new_token, write_token_file
from colocar.sizes import parse_size

from .cluster import Cluster, Host, split_devices
from .connection import HostConnection
from .exits import ExitWatch
from .local_sidecars import Sidecar, wait_ready

MiB = 1 << 20


def _workdir_with_token() -> tuple[str, str, str]:
    """A fresh work folder holding a new token in its 0600 file: (folder, token, file)."""
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
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child_env = {**os.environ, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, child_env.get("PYTHONPATH", "")) if p)
    return child_env


def _shutdown(sidecars: list[Sidecar], workdir: str, persist: bool) -> None:
    """Stops the sidecars and removes the work folder; with `persist` they outlive us, but the
    files of those already killed are removed (nobody else would)."""
    if persist:
        for sidecar in sidecars:
            if sidecar.status() is not None:
                sidecar.remove_files()
        return
    for sidecar in sidecars:  # all drain at once
        sidecar.terminate()
    for sidecar in sidecars:
        sidecar.stop(grace=10)
    shutil.rmtree(workdir, ignore_errors=True)


class LocalCluster(Cluster):
    """A `Cluster` of sidecars this process started; `restart_host` brings a dead one back."""

    _spawn: tuple[list[Sidecar], list[str], dict[str, str]]
    _exits: ExitWatch

    def restart_host(self, host: int | str, timeout: float = 120.0, *, address: str | None = None) -> Host:
        """Starts the sidecar of `host` (its index or name) again after it died, with the same
        options, on its address or on `address` (`"127.0.0.1:0"`: a free port, as a
        replacement machine would have a new address), and connects to it: the host keeps its
        name, index and devices, with a new connection (a new session; its old remote objects
        are gone). For drills of a host coming back (`colocar.elastic` then scales back up).
        Raises `ColocarError` if that sidecar still runs, or if the new one does not start."""
        target = self.host(host)
        sidecars, argv, env = self._spawn
        sidecar = sidecars[self.hosts.index(target)]
        if sidecar.process.poll() is None:
            raise ColocarError(
                f"sidecar {target.name} (pid {sidecar.process.pid}) still runs: only a dead one is restarted"
            )
        if address is None:
            address = (sidecar.info or {}).get("address", "127.0.0.1:0")
        old = target.connection
        old.close()  # lost already: ends its threads, calls nobody
        sidecar.remove_files()  # a killed sidecar leaves its arena and link socket
        argv = list(argv)
        argv[argv.index("--address") + 1] = address
        sidecar.spawn(argv, env, persist="--parent-pid" not in argv)
        self.processes[self.hosts.index(target)] = sidecar.process  # type: ignore[attr-defined]
        wait_ready([sidecar], timeout)
        assert sidecar.info is not None
        target.connection = old.replacement(sidecar.info["address"], process_status=sidecar.status)
        sidecar.watch_exit(self._exits, target.connection)
        return target


class ClusterDroppedWarning(UserWarning):
    """A local cluster was dropped (a notebook cell re-run, a variable reassigned) unclosed."""


def _shutdown_dropped(hosts: list[Host], shutdown: Callable[[], None], what: str, doing: str) -> None:
    """A dropped cluster's finalizer: warns, then closes its sessions and stops its sidecars in
    a thread of its own (the collection that found it may run in any thread, even one of
    these connections'); the thread is not a daemon, so an exiting interpreter finishes it."""
    warnings.warn(
        f"{what} was dropped without close(): {doing}. Close clusters "
        "you replace (cluster.close(), or `with colocar.local_cluster(...) as cluster:`)",
        ClusterDroppedWarning,
        stacklevel=2,
    )

    def run() -> None:
        for host in hosts:
            host.connection.close()
        shutdown()

    threading.Thread(target=run, name="colocar-dropped-cluster").start()


def _owned_cluster(
    hosts: list[Host], sidecars: list[Sidecar], files: tuple[str, bool], arena_size: str
) -> LocalCluster:
    """A cluster of `sidecars` that stop on `close()`, or once nothing holds it any more (with
    a `ClusterDroppedWarning`). At interpreter exit nothing runs: `--parent-pid` stops them.
    `files`: the work folder and `persist` (see `_shutdown`); `arena_size`: as in the flag.
    A sidecar that dies marks its host lost at once (`ExitWatch`)."""
    exits = ExitWatch()
    for host, sidecar in zip(hosts, sidecars, strict=True):
        sidecar.watch_exit(exits, host.connection)
    stop_sidecars = functools.partial(_shutdown, sidecars, *files)

    def shutdown() -> None:
        exits.close()
        stop_sidecars()

    what = f"a local_cluster of {len(hosts)} sidecar(s) with {parse_size(arena_size) // MiB} MiB arenas"
    doing = (
        "closing its connections (persist=True: its sidecars keep running)"
        if files[1]
        else "stopping its sidecars"
    )
    dropped: list[weakref.finalize] = []

    def on_close() -> None:
        dropped[0].detach()
        shutdown()

    cluster = LocalCluster(hosts, on_close=on_close)
    cluster._exits = exits
    dropped.append(weakref.finalize(cluster, _shutdown_dropped, hosts, shutdown, what, doing))
    dropped[0].atexit = False
    cluster.processes = [s.process for s in sidecars]  # type: ignore[attr-defined]
    cluster.log_files = [s.log_file for s in sidecars]  # type: ignore[attr-defined]
    return cluster


def _connect(
    sidecars: list[Sidecar],
    groups: list[list[Any]],
    token: str,
    *,
    startup_timeout: float,
    shm: bool,
    lease_seconds: float,
    heartbeat_seconds: float,
    alloc_timeout: float,
) -> list[Host]:
    """Waits for the sidecars to be ready, then connects to all at once (sidecar i gets device
    group i); on a failure, closes the connections that were made and raises the first."""
    options = dict(shm=shm, lease_seconds=lease_seconds, heartbeat_seconds=heartbeat_seconds)

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
) -> LocalCluster:
    """Starts `hosts` sidecars on loopback and connects to them.

    `devices` (default: all local JAX devices) are split into equal contiguous groups, one per
    host. `shm_dir` defaults to `COLOCAR_SHM_DIR` or /dev/shm. `shm=False` makes the controller
    move bulk data through gRPC streams as it would for remote sidecars. With `persist=True`
    the sidecars outlive this process; `cluster.token_file` and the host addresses let a later
    process `connect(...)` to them. `alloc_timeout` is how long an arena allocation (on either
    side) waits for room in a full pool before it fails.
    """
    groups = split_devices(devices if devices is not None else jax.local_devices(), hosts)
    shm_dir = shm_dir or os.environ.get("COLOCAR_SHM_DIR", "/dev/shm")
    workdir, token, token_file = _workdir_with_token()
    argv = _sidecar_argv(
        shm_dir,
        token_file,
        pools,
        persist,
        arena_size=arena_size,
        lease_seconds=lease_seconds,
        processes=processes,
        threads=threads,
        alloc_timeout=alloc_timeout,
    )
    sidecars = [Sidecar(i, workdir, argv, _sidecar_env(env), persist) for i in range(hosts)]
    try:
        connected = _connect(
            sidecars,
            groups,
            token,
            startup_timeout=startup_timeout,
            shm=shm,
            lease_seconds=lease_seconds,
            heartbeat_seconds=heartbeat_seconds,
            alloc_timeout=alloc_timeout,
        )
    except BaseException:
        _shutdown(sidecars, workdir, persist=False)  # a failed start leaves nothing running
        raise
    cluster = _owned_cluster(connected, sidecars, (workdir, persist), str(arena_size))
    cluster.token_file = token_file  # type: ignore[attr-defined]
    cluster._spawn = (sidecars, argv, _sidecar_env(env))
    return cluster
