"""The job's directory, on a file system every node sees: token, rendezvous, control.

`colocar slurm run` keeps here (mode 0700) what the tasks of a job share: the token (a 0600
file, written once by whichever task comes first), each node's sidecar address (the tasks
wait for all of them), `connection.json` (what `colocar.connect()` reads in an salloc shell
or a notebook) and, per job step, the trainers' generation (one more per restart in place)
and the step's end. Files are written whole (a temporary file, then a rename or a link), so
a reader never sees half of one; a few small files polled once a second suit NFS as well.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
import time
from collections.abc import Callable
from typing import Any

from colocar.controller_bridge.addresses import CONNECTION_FILE, job_dir
from colocar.protocol.tokens import new_token, write_token_file

from .task import SlurmError

POLL_SECONDS = 0.5


def default_job_dir(job_id: int) -> str:
    """`$COLOCAR_JOB_DIR`, else `~/.colocar/slurm/<job id>` (home is shared on most clusters)."""
    return os.environ.get("COLOCAR_JOB_DIR") or job_dir(job_id)


def _tmp_name(path: str) -> str:
    return f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def _write_whole(path: str, data: Any) -> None:
    tmp = _tmp_name(path)
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _create_once(path: str, text: str) -> None:
    """Writes `path` unless it exists (the first writer wins; readers may see it empty)."""
    with contextlib.suppress(FileExistsError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)


def _read(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


class JobDir:
    """The directory of one job; `step(step_id)` the part of one of its job steps."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        os.makedirs(self.path, mode=0o700, exist_ok=True)

    def token_file(self, name: str = "token") -> str:
        """The job's token file `name` (the sidecars' `token`; a pool's node and admin tokens),
        made by the first task to get here (create-once: a link)."""
        path = os.path.join(self.path, name)
        if not os.path.exists(path):
            tmp = _tmp_name(path)
            write_token_file(tmp, new_token())
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)  # atomic, and never replaces another task's token
            os.unlink(tmp)
        mode = os.stat(path).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SlurmError(f"{path} is readable by others (mode {stat.filemode(mode)}): make it 0600")
        return path

    def step(self, step_id: str, restart_count: int = 0) -> StepDir:
        """The files of one job step: one folder per step and run (a requeued job's steps have
        the same ids again, and what an earlier run left must not be taken for theirs)."""
        return StepDir(os.path.join(self.path, f"step-{step_id}.{restart_count}"))

    def write_connection(self, sidecars: list[str], token_file: str, topology: str) -> None:
        _write_whole(
            os.path.join(self.path, CONNECTION_FILE),
            {"sidecars": sidecars, "token_file": token_file, "topology": topology},
        )

    def remove_connection(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.path, CONNECTION_FILE))


class StepDir:
    """One job step's rendezvous and control files."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.join(path, "sidecars"), mode=0o700, exist_ok=True)

    def publish(self, node_id: int, record: dict[str, Any]) -> None:
        _write_whole(os.path.join(self.path, "sidecars", f"{node_id}.json"), record)

    def wait_sidecars(self, nodes: int, timeout: float, check: Callable[[], None]) -> list[dict[str, Any]]:
        """Every node's sidecar record, by node id, once all are published; `check` raises
        if this node cannot go on (its sidecar died, a signal came) while it waits."""
        deadline = time.monotonic() + timeout
        folder = os.path.join(self.path, "sidecars")
        paths = [os.path.join(folder, f"{i}.json") for i in range(nodes)]
        while True:
            missing = [i for i, path in enumerate(paths) if not os.path.exists(path)]
            if not missing:
                return [_read(path) for path in paths]
            if time.monotonic() > deadline:
                raise SlurmError(f"the sidecars of nodes {missing} did not start within {timeout:.0f} s")
            check()
            time.sleep(POLL_SECONDS)

    def generation(self) -> int:
        """How many times the step's trainers were restarted together."""
        found = [int(n.split(".", 1)[1]) for n in os.listdir(self.path) if n.startswith("generation.")]
        return max(found, default=0)

    def bump(self, seen: int, why: str) -> int:
        """Starts generation `seen + 1` (once, whichever task asks first); the one now current."""
        _create_once(os.path.join(self.path, f"generation.{seen + 1}"), why)
        return self.generation()

    def end(self, code: int, why: str) -> None:
        """The step is over for every task: the controller ended, or a trainer failed for good."""
        _create_once(os.path.join(self.path, "end"), json.dumps({"code": code, "why": why}))

    def ended(self) -> dict[str, Any] | None:
        try:
            return _read(os.path.join(self.path, "end"))
        except (FileNotFoundError, json.JSONDecodeError):  # not yet, or being written
            return None
