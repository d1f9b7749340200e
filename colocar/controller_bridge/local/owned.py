"""A local cluster's sidecars owned by its controller: stopped on close, or when dropped (controller).

`close()` stops the sidecars (with `persist=True` they keep running, and only the files of
those already killed are removed: nobody else would), `shutdown()` stops them whatever
`persist` says, and a cluster nobody holds any more (a notebook cell run again) shuts down too,
with a `ClusterDroppedWarning`. At interpreter exit only the work folder (token, logs) of
sidecars that do not persist is removed: `--parent-pid` stops them. A sidecar that dies marks its
host lost at once (`ExitWatch`); `restart_host` brings it back.
"""

from __future__ import annotations

import os
import shutil
import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

from colocar import pids
from colocar.errors import ColocarError

from ..cluster import Cluster, Host
from . import records
from .exits import ExitWatch
from .sidecars import Sidecar, wait_ready

MiB = 1 << 20


@dataclass
class Sidecars:
    """What a local cluster started, and how: to stop them, or to start one again."""

    sidecars: list[Sidecar]
    argv: list[str]
    env: dict[str, str]
    workdir: str
    persist: bool
    session: str = ""  # a persistent named cluster has a record under this name
    arena_bytes: int = 0

    def save(self) -> None:
        """Writes what `records` keeps of this cluster (see `reattach` and `colocar clean`)."""
        hosts = []
        for sidecar in self.sidecars:
            try:
                start = pids.start_of(sidecar.process.pid)
            except psutil.Error:  # it ended already: nothing of it to find again
                start = {"started": 0.0}
            hosts.append({**(sidecar.info or {}), "pid": sidecar.process.pid, **start})
        controller = {"pid": os.getpid(), **pids.start_of(os.getpid())}
        record = {"workdir": self.workdir, "argv": self.argv, "arena_bytes": self.arena_bytes, "hosts": hosts}
        records.save(self.workdir, self.session, {**record, "controller": controller})

    def stop(self, persist: bool | None = None) -> None:
        """Stops the sidecars and removes the work folder (and the record); a persistent one's
        sidecars outlive us (unless `persist=False` here), but the files of those already
        killed are removed."""
        if self.persist if persist is None else persist:
            for sidecar in self.sidecars:
                if sidecar.status() is not None:
                    sidecar.remove_files()
            return
        for sidecar in self.sidecars:  # all drain at once
            sidecar.terminate()
        for sidecar in self.sidecars:
            sidecar.stop(grace=10)
        shutil.rmtree(self.workdir, ignore_errors=True)
        if self.session:
            records.remove(self.session)


class LocalCluster(Cluster):
    """A `Cluster` of sidecars this process started (or, persistent and named, reattached
    to); `restart_host` brings a dead one back, `shutdown` stops them even when persistent."""

    processes: list[Any]  # each sidecar's process (Popen, or an adopted one's stand-in)
    log_files: list[str]
    token_file: str
    _spawn: Sidecars
    _exits: ExitWatch

    def restart_host(self, host: int | str, timeout: float = 120.0, *, address: str | None = None) -> Host:
        """Starts the sidecar of `host` (its index or name) again after it died, with the same
        options, on its address or on `address` (`"127.0.0.1:0"`: a free port, as a
        replacement machine would have a new address), and connects to it: the host keeps its
        name, index and devices, with a new connection (a new session; its old remote objects
        are gone). For drills of a host coming back (`colocar.elastic` then scales back up).
        Raises `ColocarError` if that sidecar still runs, or if the new one does not start."""
        target = self.host(host)
        spawn = self._spawn
        sidecar = spawn.sidecars[self.hosts.index(target)]
        if sidecar.process.poll() is None:
            raise ColocarError(
                f"sidecar {target.name} (pid {sidecar.process.pid}) still runs: only a dead one is restarted"
            )
        if address is None:
            address = (sidecar.info or {}).get("address", "127.0.0.1:0")
        old = target.connection
        old.close()  # lost already: ends its threads, calls nobody
        sidecar.remove_files()  # a killed sidecar leaves its arena and link socket
        argv = list(spawn.argv)
        argv[argv.index("--address") + 1] = address
        sidecar.spawn(argv, spawn.env)
        self.processes[self.hosts.index(target)] = sidecar.process
        wait_ready([sidecar], timeout)
        assert sidecar.info is not None
        target.connection = old.replacement(sidecar.info["address"], process_status=sidecar.status)
        sidecar.watch_exit(self._exits, target.connection)
        spawn.save()
        return target

    def shutdown(self) -> None:
        """Closes the cluster and stops its sidecars, also persistent ones (whose record goes)."""
        self.close()
        self._spawn.stop(persist=False)


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


def owned_cluster(hosts: list[Host], spawn: Sidecars) -> LocalCluster:
    """A cluster of `spawn`'s sidecars, which stop on `close()` or once nothing holds it any
    more (see the module)."""
    exits = ExitWatch()
    for host, sidecar in zip(hosts, spawn.sidecars, strict=True):
        sidecar.watch_exit(exits, host.connection)

    def shutdown() -> None:
        exits.close()
        spawn.stop()

    what = f"a local_cluster of {len(hosts)} sidecar(s) with {spawn.arena_bytes // MiB} MiB arenas"
    doing = (
        "closing its connections (persist=True: its sidecars keep running)"
        if spawn.persist
        else "stopping its sidecars"
    )
    dropped: list[weakref.finalize] = []

    def on_close() -> None:
        dropped[0].detach()
        shutdown()

    cluster = LocalCluster(hosts, on_close=on_close)
    cluster._exits = exits
    cluster._spawn = spawn
    dropped.append(weakref.finalize(cluster, _shutdown_dropped, hosts, shutdown, what, doing))
    dropped[0].atexit = False
    if not spawn.persist:  # at exit the sidecars stop by themselves; their folder goes here
        weakref.finalize(cluster, shutil.rmtree, spawn.workdir, True)
    cluster.processes = [s.process for s in spawn.sidecars]
    cluster.log_files = [s.log_file for s in spawn.sidecars]
    cluster.token_file = os.path.join(spawn.workdir, "token")
    return cluster
