"""The node's sidecar under `colocar slurm run`: started, awaited, stopped, cleaned up.

The sidecar runs with `--stop-signal USR2`: Slurm signals every process of a step at once
(scancel, the time limit's `--signal`), and the sidecar must outlive its trainer's last
save, so only this supervisor stops it, after the trainer. It also ends with the supervisor
(`--parent-pid`). A port another process holds is skipped (`ports.sidecar_ports`). After it
ends, killed or not, no arena of a dead sidecar stays in its shm directory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from colocar.controller_bridge.local.sidecars import Sidecar, wait_ready
from colocar.errors import ColocarError
from colocar.shm.arena import remove_stale_arenas

from . import ports
from .task import SlurmError, SlurmTask

STARTUP_SECONDS = 600.0  # pre-faulting a large arena takes a while (about 1 GB/s)
DRAIN_SECONDS = 10.0


class NodeSidecar:
    """The sidecar process of this node (a local cluster's `Sidecar`: its ready pipe and log,
    in `log_dir`), once `start` returned: `port`, `info` (its ready line: pid, arena)."""

    def __init__(self, task: SlurmTask, token_file: str, shm_dir: str, log_dir: str, options: Sequence[str]):
        self.task, self.token_file, self.shm_dir, self.options = task, token_file, shm_dir, list(options)
        self.sidecar = Sidecar(task.node_id, log_dir, label=f"slurm{task.job_id}-{task.node_name}")
        self.port = 0
        self.info: dict[str, Any] = {}

    @property
    def log_file(self) -> str:
        return self.sidecar.log_file

    def start(self) -> NodeSidecar:
        """Starts on the first free candidate port; waits until it serves."""
        for port in ports.sidecar_ports(self.task.job_id, self.task.node_id):
            if not ports.is_free(port):
                continue
            try:
                return self._serve_on(port)
            except ColocarError as e:
                if "cannot bind" not in str(e):  # else another process took the port meanwhile
                    raise SlurmError(f"the sidecar of {self.task.node_name} failed to start: {e}") from None
        raise SlurmError(f"no free sidecar port for job {self.task.job_id} on {self.task.node_name}")

    def restart(self) -> NodeSidecar:
        """Starts it again on its port, after it died (an empty arena; its dead one removed)."""
        try:
            return self._serve_on(self.port)
        except ColocarError as e:
            raise SlurmError(f"the sidecar of {self.task.node_name} failed to start again: {e}") from None

    def _serve_on(self, port: int) -> NodeSidecar:
        argv = [
            sys.executable, "-m", "colocar.sidecar",
            "--address", f"0.0.0.0:{port}",
            "--shm-dir", self.shm_dir,
            "--token-file", self.token_file,
            "--parent-pid", str(os.getpid()),
            "--stop-signal", "USR2",
            "--drain-seconds", str(DRAIN_SECONDS),
            *self.options,
        ]  # fmt: skip
        self.sidecar.spawn(argv, dict(os.environ))
        wait_ready([self.sidecar], STARTUP_SECONDS)
        self.port, self.info = port, dict(self.sidecar.info or {})
        return self

    def exited(self) -> int | None:
        """Its exit status once it ended (after `start`), else None."""
        return self.sidecar.process.poll()

    def stop(self) -> None:
        """Drains it (SIGUSR2), kills it if it hangs, and removes a dead sidecar's arena."""
        process = getattr(self.sidecar, "process", None)  # none if it never started
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGUSR2)
            try:
                process.wait(DRAIN_SECONDS + 20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        remove_stale_arenas(self.shm_dir)

    def log_tail(self) -> str:
        return self.sidecar.log_tail()
