"""Reattaching to the sidecars of a persistent, named local cluster (controller).

`local_cluster(persist=True, session=NAME)` first looks for the record of NAME (`records`).
When every sidecar in it still runs, it connects to them under that session name instead of
starting new ones: the new controller takes the session over, with its named objects (what the
old controller held besides is freed, see `colocar.sidecar.session_service`), and owns the
sidecars as if it had started them (`restart_host`, `shutdown`). When only some still run, the
session lost part of what it held: they are stopped, with a warning, and a new cluster starts.
A record of another number of hosts is an error that says how to stop its sidecars.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable
from typing import Any

from colocar.errors import ColocarError

from ..cluster import Host
from . import records
from .owned import LocalCluster, Sidecars, owned_cluster
from .sidecars import Sidecar

Connect = Callable[[list[Sidecar], list[list[Any]], str], list[Host]]


def reattach(
    session: str, groups: list[list[Any]], connect: Connect, env: dict[str, str]
) -> LocalCluster | None:
    """The cluster of the recorded sidecars of `session`, connected (`connect(sidecars,
    groups, token)`), or None when there is none to reattach to (no record, or a stale one,
    now removed)."""
    record = records.read(session)
    if record is None:
        return None
    hosts: list[dict[str, Any]] = record["hosts"]
    sidecars = [Sidecar(i, record["workdir"]).adopt(info) for i, info in enumerate(hosts)]
    spawn = Sidecars(sidecars, record["argv"], env, record["workdir"], True, session, record["arena_bytes"])
    gone = [f"host{i}" for i, host in enumerate(hosts) if not records.running(host)]
    if gone:
        if len(gone) < len(hosts):
            warnings.warn(
                f"colocar: session {session!r}: the persistent sidecars of {gone} are gone; stopping "
                "the others and starting a new cluster",
                stacklevel=3,
            )
        spawn.stop(persist=False)
        return None
    if len(hosts) != len(groups):
        raise ColocarError(
            f"session {session!r} has {len(hosts)} persistent sidecars running, not {len(groups)}: "
            f"ask for hosts={len(hosts)}, or stop them first (`colocar sessions stop {session}`)"
        )
    with open(f"{record['workdir']}/token") as f:
        token = f.read().strip()
    return owned_cluster(connect(sidecars, groups, token), spawn)


def stop(session: str) -> bool:
    """Stops the recorded sidecars of `session` and removes the record; False if none."""
    record = records.read(session)
    if record is None:
        return False
    sidecars = [Sidecar(i, record["workdir"]).adopt(info) for i, info in enumerate(record["hosts"])]
    for sidecar, host in zip(sidecars, record["hosts"], strict=True):
        if records.running(host):
            sidecar.terminate()
    for sidecar, host in zip(sidecars, record["hosts"], strict=True):
        if records.running(host):
            sidecar.stop(grace=10)
        else:
            sidecar.remove_files()
    shutil.rmtree(record["workdir"], ignore_errors=True)
    records.remove(session)
    return True
