"""Records of persistent, named local clusters, so that a later controller finds their sidecars.

Runs in the controller. `local_cluster(persist=True, session="nb")` writes one JSON record per
session name into the state directory (`COLOCAR_STATE_DIR`, default `<tmp>/colocar-<uid>`,
mode 0700): the sidecars' addresses, pids, start times and arenas, the token file, the work
folder and the command line they were started with. The same call in a new process (after a
kernel restart) reads it back and, when every sidecar in it still runs, connects to them
instead of starting new ones, taking the session over. `colocar sessions ls` lists them,
`colocar sessions stop NAME` and `LocalCluster.shutdown()` stop them, `colocar clean` removes
records whose sidecars are all gone.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import tempfile
from typing import Any

import psutil

from colocar import pids

SUFFIX = ".json"
WORKDIR_RECORD = "cluster.json"


def _state_dir() -> str:
    default = os.path.join(tempfile.gettempdir(), f"colocar-{os.getuid()}")
    return os.environ.get("COLOCAR_STATE_DIR") or default


def state_dir() -> str:
    """The folder of the records (made, mode 0700, if missing)."""
    path = _state_dir()
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def _path(session: str) -> str:
    return os.path.join(_state_dir(), session + SUFFIX)


def write(path: str, record: dict[str, Any]) -> None:
    """Writes a record atomically (a reader never sees half of it), mode 0600."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)


def save(workdir: str, session: str, record: dict[str, Any]) -> None:
    """Every local cluster's record in its work folder (`colocar clean` finds folders left by
    killed controllers by it); a persistent named one's also in the state folder."""
    write(os.path.join(workdir, WORKDIR_RECORD), record)
    if session:
        write(os.path.join(state_dir(), session + SUFFIX), {"session": session, **record})


def read(session: str) -> dict[str, Any] | None:
    """The record of `session`, or None (none, or unreadable: it is then ignored)."""
    return read_file(_path(session))


def read_file(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("hosts"), list) else None


def remove(session: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_path(session))


def every() -> list[dict[str, Any]]:
    """Every readable record of a persistent named cluster, by session name."""
    try:
        names = sorted(n.removesuffix(SUFFIX) for n in os.listdir(_state_dir()) if n.endswith(SUFFIX))
    except FileNotFoundError:  # none was ever written
        return []
    return [r for r in (read(n) for n in names) if r is not None]


def left_over() -> list[dict[str, Any]]:
    """The records of local clusters whose controller and sidecars all ended: in the state
    folder, and in work folders (`colocar-*` in the temporary folder) whose controller did not
    remove them (it was killed); each with its "path". A live controller's folder is kept
    even when its sidecars died: it holds their logs and the token a restart needs. A record
    of another PID namespace is never left over: nobody here can tell."""
    found = [{**r, "path": _path(r["session"])} for r in every()]
    for folder in glob.glob(os.path.join(tempfile.gettempdir(), "colocar-*", WORKDIR_RECORD)):
        record = read_file(folder)
        if record is not None:
            found.append({**record, "path": folder})
    return [r for r in found if not any(_maybe_running(p) for p in [*r["hosts"], r.get("controller", {})])]


def _maybe_running(recorded: dict[str, Any]) -> bool:
    """Whether a record's process may still run: it does, or it ran in another PID namespace
    (a container sharing this /tmp) where this process cannot tell."""
    return pids.elsewhere(recorded) or running(recorded)


def remove_left_over(record: dict[str, Any]) -> list[str]:
    """Removes a `left_over` record and its work folder; the paths removed."""
    removed = []
    for path in (record["path"], record.get("workdir")):
        if path and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        elif path and os.path.exists(path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(path)
    return removed


def process_of(recorded: dict[str, Any]) -> psutil.Process | None:
    """The process a record names (a host's sidecar, the controller), if its pid still names
    it: the process `pids.start_of` saw."""
    return pids.process_with(recorded.get("pid", -1), recorded)


def alive(process: psutil.Process | None) -> bool:
    """Whether `process` still runs (a zombie nobody reaped has ended)."""
    try:
        return process is not None and process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def running(recorded: dict[str, Any]) -> bool:
    """Whether the process a record names still runs."""
    return alive(process_of(recorded))
