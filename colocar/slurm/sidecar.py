"""The node's sidecar under `colocar slurm run`: started, awaited, stopped, cleaned up.

The sidecar runs with `--stop-signal USR2`: Slurm signals every process of a step at once
(scancel, the time limit's `--signal`), and the sidecar must outlive its trainer's last
save, so only this supervisor stops it, after the trainer. It also ends with the supervisor
(`--parent-pid`). A port another process holds is skipped (`ports.sidecar_ports`). After it
ends, killed or not, no arena of a dead sidecar stays in its shm directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from colocar.shm.arena import remove_stale_arenas

from . import ports
from .task import SlurmError, SlurmTask

STARTUP_SECONDS = 600.0  # pre-faulting a large arena takes a while (about 1 GB/s)
DRAIN_SECONDS = 10.0


class NodeSidecar:
    """The sidecar process of this node, once `start` returned: `address` (this machine's
    port), `info` (its ready line: pid, arena)."""

    def __init__(self, task: SlurmTask, token_file: str, shm_dir: str, log_file: str, options: Sequence[str]):
        self.task, self.token_file, self.shm_dir = task, token_file, shm_dir
        self.log_file, self.options = log_file, list(options)
        self.process: subprocess.Popen | None = None
        self.port = 0
        self.info: dict[str, Any] = {}

    def start(self) -> NodeSidecar:
        """Starts on the first free candidate port; waits until it serves."""
        for port in ports.sidecar_ports(self.task.job_id, self.task.node_id):
            if not ports.is_free(port):
                continue
            info = self._spawn(port)
            if info is not None:
                self.port, self.info = port, info
                return self
            if "cannot bind" not in self.log_tail():
                raise SlurmError(f"the sidecar of {self.task.node_name} failed to start:\n{self.log_tail()}")
        raise SlurmError(f"no free sidecar port for job {self.task.job_id} on {self.task.node_name}")

    def restart(self) -> NodeSidecar:
        """Starts it again on its port, after it died (an empty arena; its dead one removed)."""
        info = self._spawn(self.port)
        if info is None:
            raise SlurmError(
                f"the sidecar of {self.task.node_name} failed to start again:\n{self.log_tail()}"
            )
        self.info = info
        return self

    def _argv(self, port: int, ready_fd: int) -> list[str]:
        return [
            sys.executable, "-m", "colocar.sidecar",
            "--address", f"0.0.0.0:{port}",
            "--shm-dir", self.shm_dir,
            "--token-file", self.token_file,
            "--label", f"slurm{self.task.job_id}-{self.task.node_name}",
            "--parent-pid", str(os.getpid()),
            "--stop-signal", "USR2",
            "--drain-seconds", str(DRAIN_SECONDS),
            "--ready-fd", str(ready_fd),
            *self.options,
        ]  # fmt: skip

    def _spawn(self, port: int) -> dict[str, Any] | None:
        """Runs the sidecar on `port`; its ready line, or None if it exited first."""
        read_end, write_end = os.pipe()
        try:
            with open(self.log_file, "ab") as log:
                self.process = subprocess.Popen(
                    self._argv(port, write_end),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    pass_fds=(write_end,),
                )
            os.close(write_end)
            return _ready_line(read_end, self.process)
        finally:
            with contextlib.suppress(OSError):
                os.close(write_end)
            os.close(read_end)

    def exited(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def stop(self) -> None:
        """Drains it (SIGUSR2), kills it if it hangs, and removes a dead sidecar's arena."""
        process = self.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGUSR2)
            try:
                process.wait(DRAIN_SECONDS + 20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        remove_stale_arenas(self.shm_dir)

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_file, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except FileNotFoundError:
            return ""


def _ready_line(fd: int, process: subprocess.Popen) -> dict[str, Any] | None:
    """The sidecar's JSON line on its ready pipe; None once the pipe ends without one."""
    buffer, deadline = b"", time.monotonic() + STARTUP_SECONDS
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while not buffer.endswith(b"\n"):
            if time.monotonic() > deadline:
                process.kill()
                raise SlurmError(f"the sidecar did not start within {STARTUP_SECONDS:.0f} s")
            if selector.select(timeout=1.0):
                chunk = os.read(fd, 65536)
                if not chunk:
                    process.wait()
                    return None
                buffer += chunk
    return json.loads(buffer)
