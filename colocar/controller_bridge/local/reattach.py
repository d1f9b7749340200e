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

import warnings
from collections.abc import Callable
from typing import Any

from colocar.errors import ColocarError

from ..cluster import Host
from . import records
from .owned import LocalCluster, Sidecars, owned_cluster
from .sidecars import Sidecar

Connect = Callable[[list[Sidecar], list[list[Any]], str], list[Host]]


def _recorded(session: str, env: dict[str, str]) -> Sidecars | None:
    """The sidecars the record of `session` names (adopted: this process did not start them)."""
    record = records.read(session)
    if record is None:
        return None
    sidecars = [Sidecar(i, record["workdir"]).adopt(info) for i, info in enumerate(record["hosts"])]
    return Sidecars(sidecars, record["argv"], env, record["workdir"], True, session, record["arena_bytes"])


def reattach(
    session: str, groups: list[list[Any]], connect: Connect, env: dict[str, str]
) -> LocalCluster | None:
    """The cluster of the recorded sidecars of `session`, connected (`connect(sidecars,
    groups, token)`), or None when there is none to reattach to (no record, or a stale one,
    now removed)."""
    spawn = _recorded(session, env)
    if spawn is None:
        return None
    gone = [f"host{s.index}" for s in spawn.sidecars if s.status() is not None]
    if gone:
        if len(gone) < len(spawn.sidecars):
            warnings.warn(
                f"colocar: session {session!r}: the persistent sidecars of {gone} are gone; stopping "
                "the others and starting a new cluster",
                stacklevel=3,
            )
        spawn.stop(persist=False)
        return None
    if len(spawn.sidecars) != len(groups):
        raise ColocarError(
            f"session {session!r} has {len(spawn.sidecars)} persistent sidecars running, not "
            f"{len(groups)}: ask for hosts={len(spawn.sidecars)}, or stop them first "
            f"(`colocar sessions stop {session}`)"
        )
    with open(f"{spawn.workdir}/token") as f:
        token = f.read().strip()
    cluster = owned_cluster(connect(spawn.sidecars, groups, token), spawn)
    spawn.save()  # this process is their controller now
    return cluster


def stop(session: str) -> bool:
    """Stops the recorded sidecars of `session`, removes their files, folder and the record;
    False if there is none."""
    spawn = _recorded(session, {})
    if spawn is None:
        return False
    spawn.stop(persist=False)
    return True
