"""`colocar slurm pool-task`: one task of a shared pool's Slurm job (`render --pool`).

Every task runs the pool node daemon of its node (`colocar pool node`) at the node's
`NodeAddr` and a port of the job's (`ports.py`), its arenas in a folder of /dev/shm named by
the job and the node; the task of node 0 then also runs the pool's agent, with `--nodes`
listing every node in the step's order, and writes the pool file `DIR/pool.json` in the
record format of `colocar pool up`. The node and admin tokens are the job's (0600 files in the
job directory). Tenants run their job steps in the pool's allocation and connect through the
pool file:

    srun --jobid=<pool job id> --overlap -N 2 --ntasks-per-node=1 python train.py
    # train.py: colocar.connect(pool="DIR/pool.json", token_file="my.token")

A node daemon, and a tenant's task, know their machine by Slurm's node name
(`SLURMD_NODENAME`; not the host name: several slurmd may share a host), so each process of a
multi-controller job gets the sidecar on its own node. SIGTERM (scancel) removes the pool
file, stops the agent (it stops the tenants), then the node (it stops its sidecars), and
removes the arena folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from colocar.controller_bridge.local.sidecars import Sidecar, wait_ready
from colocar.errors import ColocarError
from colocar.pool.cli import pool_record, write_pool_file

from . import ports
from .jobdir import JobDir, default_job_dir
from .supervisor import dies_with
from .task import SlurmError, SlurmTask, hostnames, node_address

POLL_SECONDS = 0.5
STARTUP_SECONDS = 120.0
STOP_SECONDS = 20.0  # within Slurm's KillWait (30 s by default) after scancel's SIGTERM
NODE_TOKEN, ADMIN_TOKEN, POOL_FILE = "pool-node.token", "pool-admin.token", "pool.json"


@dataclass
class PoolOptions:
    tenants: str
    pool_dir: str | None = None  # default: the job directory
    job_dir: str | None = None
    capacity: str = "1G"
    max_tenants: int = 8
    idle_seconds: float = 60.0
    lease_seconds: float = 30.0
    shm_root: str = "/dev/shm"
    startup_timeout: float = 600.0


def shm_dir(root: str, job_id: int, node: str) -> str:
    """The node's arena folder: named by job and node (several slurmd may share a machine), it
    matches the job's `colocar-slurm<job>-*` and is removed whole when the task ends."""
    return os.path.join(root, f"colocar-slurm{job_id}-pool-{node}")


class Daemon(Sidecar):
    """A pool node or agent process: a sidecar's ready pipe and log, and it gets SIGKILL when
    this task ends, even killed outright (no daemon outlives its task)."""

    def spawn(self, argv: list[str], env: dict[str, str], tied: Callable[[], None] | None = None) -> Daemon:
        super().spawn(argv, env, tied or dies_with(os.getpid()))
        return self

    def running(self) -> bool:
        return getattr(self, "process", None) is not None and self.process.poll() is None

    def end(self, grace: float = STOP_SECONDS) -> None:
        """SIGTERM (it stops what it started), SIGKILL after `grace` seconds."""
        if getattr(self, "process", None) is not None:
            self.stop(grace)


def start_on_free_port(daemon: Daemon, argv: Callable[[int], list[str]], candidates: Iterator[int]) -> int:
    """Starts `daemon` on the first candidate port it can bind; the port."""
    for port in candidates:
        if not ports.is_free(port):
            continue
        daemon.spawn(argv(port), dict(os.environ))
        try:
            wait_ready([daemon], STARTUP_SECONDS)
            return port
        except ColocarError as e:
            if "cannot bind" not in str(e) and "Failed to bind" not in str(e):  # else: taken meanwhile
                raise SlurmError(str(e)) from None
    raise SlurmError(f"no free port for {daemon.label}")


class PoolTask:
    """One task of the pool's job step; `run()` returns its exit status."""

    def __init__(self, task: SlurmTask, options: PoolOptions):
        self.task, self.options = task, options
        self.signals: list[int] = []
        self.jobdir = JobDir(options.job_dir or default_job_dir(task.job_id))
        self.step = self.jobdir.step(task.step_id, task.restart_count)
        self.pool_file = os.path.join(os.path.abspath(options.pool_dir or self.jobdir.path), POOL_FILE)
        self.shm = shm_dir(options.shm_root, task.job_id, task.node_name)
        self.logs = os.path.join(self.jobdir.path, "logs")
        self.node = Daemon(task.node_id, self.logs, label=f"pool-node-{task.node_name}")
        self.agent = Daemon(0, self.logs, label="pool-agent")
        os.environ["COLOCAR_NODE_NAME"] = task.node_name  # the daemons' machine: the node, by name

    def say(self, message: str) -> None:
        print(f"colocar slurm pool-task [{self.task.node_name}]: {message}", file=sys.stderr, flush=True)

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: self.signals.append(signum))
        os.makedirs(self.logs, mode=0o700, exist_ok=True)
        os.makedirs(self.shm, mode=0o700, exist_ok=True)
        try:
            self._check()
            records = self._start_node()
            if self.task.node_id == 0:
                self._start_agent(records)
            return self._serve()
        except _Stopped:
            return 0
        except SlurmError as e:  # the other tasks stop too, at once
            self.step.end(1, f"{self.task.node_name}: {e}")
            raise
        finally:
            self._stop()

    def _check(self) -> None:
        """Raises when this task cannot go on: a signal came, a daemon died, the step ended."""
        if self.signals:
            raise _Stopped()
        for daemon in (self.node, self.agent):
            if getattr(daemon, "process", None) is not None and not daemon.running():
                raise SlurmError(f"{daemon.label} exited ({daemon.process.poll()}):\n{daemon.log_tail()}")
        ended = self.step.ended()
        if ended is not None:
            raise SlurmError(f"the pool's job step ended: {ended['why']}")

    def _start_node(self) -> list[dict[str, Any]]:
        """Starts this node's daemon, publishes it, and waits for every node's: their records."""
        token = self.jobdir.token_file(NODE_TOKEN)
        workdir = os.path.join(self.jobdir.path, "pool", self.task.node_name)
        host = os.environ.get("COLOCAR_NODE_ADDRESS") or node_address(self.task.node_name)

        def argv(port: int) -> list[str]:
            return [
                sys.executable, "-m", "colocar.pool.node_main", "--address", f"0.0.0.0:{port}",
                "--token-file", token, "--shm-dir", self.shm, "--workdir", workdir, "--advertise", host,
            ]  # fmt: skip

        port = start_on_free_port(self.node, argv, ports.sidecar_ports(self.task.job_id, self.task.node_id))
        names = hostnames(self.task.nodelist)
        record: dict[str, Any] = {"node": self.task.node_name, "address": f"{host}:{port}", "host": host}
        record.update(proc_id=self.task.proc_id, pid=os.getpid(), sidecar_pid=self.node.process.pid)
        self.step.publish(names.index(self.task.node_name), record)
        self.say(f"pool node serving at {host}:{port} (log: {self.node.log_file})")
        return self.step.wait_sidecars(len(names), self.options.startup_timeout, self._check)

    def _start_agent(self, records: list[dict[str, Any]]) -> None:
        """Starts the agent over every node, then writes the pool file (whole)."""
        o, admin = self.options, self.jobdir.token_file(ADMIN_TOKEN)
        nodes = ",".join(r["address"] for r in records)

        def argv(port: int) -> list[str]:
            return [
                sys.executable, "-m", "colocar.pool.agent_main",
                "--tenants", os.path.abspath(o.tenants), "--admin-token-file", admin,
                "--workdir", os.path.join(self.jobdir.path, "pool", "agent"),
                "--nodes", nodes, "--node-token-file", self.jobdir.token_file(NODE_TOKEN),
                "--capacity", o.capacity, "--max-tenants", str(o.max_tenants),
                "--idle-seconds", str(o.idle_seconds), "--lease-seconds", str(o.lease_seconds),
                "--shm-dir", self.shm, "--address", f"0.0.0.0:{port}",
            ]  # fmt: skip

        os.makedirs(os.path.join(self.jobdir.path, "pool", "agent"), mode=0o700, exist_ok=True)
        port = start_on_free_port(self.agent, argv, ports.agent_ports(self.task.job_id))
        info = dict(self.agent.info or {})
        info["address"] = f"{records[0]['host']}:{port}"  # it binds every interface: its NodeAddr
        record = pool_record(
            info, admin, len(records), self.shm, self.agent.log_file, slurm_job_id=self.task.job_id,
            nodes=[r["address"] for r in records], machines=[r["node"] for r in records],
        )  # fmt: skip
        write_pool_file(self.pool_file, record)
        self.say(f"pool up: agent at {record['address']}; pool file {self.pool_file}")

    def _serve(self) -> int:
        while True:
            self._check()
            time.sleep(POLL_SECONDS)

    def _stop(self) -> None:
        """The pool file first (no new tenant), then the agent (it stops the tenants on every
        node), then the node (its sidecars, if the agent could not), then the arena folder."""
        if self.signals:
            self.say(f"signal {self.signals[0]}: stopping the pool's tenants and daemons here")
        if self.task.node_id == 0:
            self._remove_pool_file()
        self.agent.end()
        self.node.end()
        shutil.rmtree(self.shm, ignore_errors=True)

    def _remove_pool_file(self) -> None:
        """Removes the pool file if it is this job's (another pool may have taken the folder)."""
        with contextlib.suppress(OSError, ValueError):
            with open(self.pool_file) as f:
                if json.load(f).get("slurm_job_id") == self.task.job_id:
                    os.unlink(self.pool_file)


class _Stopped(Exception):
    """A signal came: the task ends cleanly."""


def run(options: PoolOptions) -> int:
    """The entry point of `colocar slurm pool-task`: this task, from the SLURM_* variables."""
    return PoolTask(SlurmTask.from_env(), options).run()
