"""`colocar slurm run`: one task of a job step: the node's sidecar, then the trainer.

Multi-controller (the default): every task runs its node's trainer next to its sidecar. A
trainer that fails is restarted in place, and with it every other node's (one generation
more in the job directory, `--trainer-restarts` at most): a jax.distributed job cannot go on
without a process, and the restarted trainers resume from the sidecars' RAM. A sidecar that
died is started again, empty, on its address first: its peers' replicas refill it. Single-
controller: the first task also runs the controller; the others keep their sidecars until
it ends. Without a command every task only serves its sidecar (an salloc session).

SIGTERM and SIGINT (scancel, the time limit's `--signal`, Ctrl-C on srun) go to the trainer,
whose last save then still reaches the sidecar; the sidecar is stopped after the trainer.
On every way out the task ends what it started and leaves no arena behind.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import ports
from .jobdir import JobDir, StepDir, default_job_dir
from .sidecar import NodeSidecar
from .task import SlurmError, SlurmTask, hostnames, node_address

POLL_SECONDS = 0.5
PR_SET_PDEATHSIG = 1  # linux/prctl.h
RESTART_GRACE = 3.0  # a trainer told to restart gets this long after SIGTERM, then SIGKILL: with a
# peer gone it is likely stuck in a collective, with nothing left to finish


@dataclass
class RunOptions:
    command: list[str]
    topology: str = "multi"
    trainer_restarts: int = 0
    job_dir: str | None = None
    shm_dir: str = "/dev/shm"
    sidecar_options: list[str] = field(default_factory=list)  # --arena-size, --pool, --processes
    startup_timeout: float = 600.0


def exit_code(returncode: int) -> int:
    """A shell's exit status for a child's return code (killed by signal N: 128 + N)."""
    return returncode if returncode >= 0 else 128 - returncode


class Supervisor:
    """Runs one task; `run()` returns the task's exit status."""

    def __init__(self, task: SlurmTask, options: RunOptions):
        self.task, self.options = task, options
        self.signals: list[int] = []
        self.child: subprocess.Popen | None = None
        self.jobdir = JobDir(options.job_dir or default_job_dir(task.job_id))
        self.step = self.jobdir.step(task.step_id, task.restart_count)
        self.node = task.node_name
        self._index = 0  # this node's place in the step's node list, and its published record
        self._record: dict[str, Any] = {}

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.signals.append(signum)
        child = self.child
        if child is not None and child.poll() is None:
            child.send_signal(signum)  # the trainer's save_on_preemption, or its end

    def say(self, message: str) -> None:
        print(f"colocar slurm run [{self.node}]: {message}", file=sys.stderr, flush=True)

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        token_file = self.jobdir.token_file()
        logs = os.path.join(self.jobdir.path, "logs")
        os.makedirs(logs, mode=0o700, exist_ok=True)
        sidecar = NodeSidecar(self.task, token_file, self.options.shm_dir, logs, self.options.sidecar_options)
        try:
            self._check_signals()
            sidecar.start()
            addresses, coordinator = self._rendezvous(sidecar)
            self.say(f"sidecar serving at {addresses[self._index]} (log: {sidecar.log_file})")
            if self.task.proc_id == 0:
                self.jobdir.write_connection(addresses, token_file, self.options.topology)
            env = self._env(sidecar.port, addresses, coordinator, token_file)
            if self.options.topology == "multi" and self.options.command:
                return self._multi(sidecar, env)
            return self._single(sidecar, env)
        except _Stopped as e:
            return e.code
        except SlurmError as e:  # the other tasks need not wait for this one until a timeout
            self.step.end(1, f"{self.node}: {e}")
            raise
        finally:
            self._end_child(grace=RESTART_GRACE)
            sidecar.stop()
            if self.task.proc_id == 0:
                self.jobdir.remove_connection()

    def _check_signals(self) -> None:
        if self.signals:
            raise _Stopped(128 + self.signals[0])

    def _rendezvous(self, sidecar: NodeSidecar) -> tuple[list[str], str]:
        """Publishes this node's sidecar and waits for every node's: (their addresses in the
        step's node order, the host of process 0's node: the JAX coordinator's)."""
        names = hostnames(self.task.nodelist)
        self._index = names.index(self.node)
        host = os.environ.get("COLOCAR_NODE_ADDRESS") or node_address(self.node)
        record: dict[str, Any] = {"node": self.node, "address": f"{host}:{sidecar.port}", "host": host}
        record.update(proc_id=self.task.proc_id, pid=os.getpid(), sidecar_pid=sidecar.info["pid"])
        self.step.publish(self._index, record)
        self._record = record

        def check() -> None:
            self._check_signals()
            if sidecar.exited() is not None:
                raise SlurmError(f"the sidecar exited before the job started:\n{sidecar.log_tail()}")
            ended = self.step.ended()
            if ended is not None:
                raise SlurmError(f"the job step ended before it started: {ended['why']}")

        records = self.step.wait_sidecars(len(names), self.options.startup_timeout, check)
        coordinator = next(r["host"] for r in records if r["proc_id"] == 0)
        return [r["address"] for r in records], coordinator

    def _env(self, port: int, addresses: list[str], coordinator: str, token_file: str) -> dict[str, str]:
        env = dict(os.environ, COLOCAR_TOKEN_FILE=token_file, COLOCAR_JOB_DIR=self.jobdir.path)
        if self.options.topology == "multi":
            env.update(
                COLOCAR_SIDECARS=f"127.0.0.1:{port}",  # its own sidecar, on loopback
                COLOCAR_PEER_ADDRESS=addresses[self._index],  # how the peers' sidecars reach it
                COLOCAR_NUM_HOSTS=str(len(addresses)),
                JAX_COORDINATOR_ADDRESS=f"{coordinator}:{{port}}",  # the port: per generation
            )
            visible = env.get("CUDA_VISIBLE_DEVICES")
            if visible and "JAX_LOCAL_DEVICE_IDS" not in env:  # all of the node's GPUs, not [SLURM_LOCALID]
                env["JAX_LOCAL_DEVICE_IDS"] = ",".join(str(i) for i in range(len(visible.split(","))))
        else:
            env["COLOCAR_SIDECARS"] = ",".join(addresses)
        return env

    def _spawn(self, env: dict[str, str], generation: int) -> subprocess.Popen:
        env = dict(env, COLOCAR_RESTART=str(generation))
        if "JAX_COORDINATOR_ADDRESS" in env:
            port = ports.jax_coordinator_port(self.task.job_id, generation)
            env["JAX_COORDINATOR_ADDRESS"] = env["JAX_COORDINATOR_ADDRESS"].format(port=port)
        self.child = subprocess.Popen(self.options.command, env=env, preexec_fn=dies_with(os.getpid()))
        return self.child

    def _end_child(self, grace: float) -> None:
        """Ends the trainer if it still runs: SIGTERM, then SIGKILL after `grace` seconds."""
        child, self.child = self.child, None
        if child is None or child.poll() is not None:
            return
        child.terminate()
        try:
            child.wait(grace)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()

    def _watch(self, sidecar: NodeSidecar | None, generation: int | None, signals: bool = False) -> str:
        """Waits for what ends the current phase: "child" (the trainer exited), "sidecar" (it
        died), "ended" (the step is over), "generation" (the trainers restart), "signal" (with
        `signals`: one came, and no trainer here has to finish first)."""
        while True:
            if self.child is not None:
                try:
                    self.child.wait(POLL_SECONDS)
                    return "child"
                except subprocess.TimeoutExpired:
                    pass
            elif signals and self.signals:
                return "signal"
            else:
                time.sleep(POLL_SECONDS)
            if sidecar is not None and sidecar.exited() is not None:
                return "sidecar"
            if self.step.ended() is not None:
                return "ended"
            if generation is not None and self.step.generation() > generation:
                return "generation"

    def _multi(self, sidecar: NodeSidecar, env: dict[str, str]) -> int:
        generation = self.step.generation()
        while True:
            child = self._spawn(env, generation)
            event = self._watch(sidecar, generation)
            code = exit_code(child.returncode) if event == "child" else 1
            if event == "child" and (code == 0 or self.signals):
                return code
            self._end_child(RESTART_GRACE)
            if event == "generation":
                generation = self.step.generation()
                self.say(f"a peer's trainer failed: restarting in place (restart {generation})")
                continue
            if event == "ended":
                return _ended_code(self.step)
            lost = sidecar.exited() is not None  # its trainer fails too: it lost its sidecar
            why = f"the sidecar on {self.node} died" if lost else f"the trainer on {self.node} exited {code}"
            if generation >= self.options.trainer_restarts:
                self.step.end(code, f"{why}, no restart left")
                self.say(f"{why}; restarts used up: the job step ends")
                return code
            if lost:  # an empty one on the same address, refilled from its peers' replicas
                self.say(f"{why}:\n{sidecar.log_tail()}\nstarting it again")
                sidecar.restart()
                self.step.publish(self._index, {**self._record, "sidecar_pid": sidecar.info["pid"]})
            self.say(f"{why}: restarting every node's trainer in place")
            generation = self.step.bump(generation, why)

    def _single(self, sidecar: NodeSidecar, env: dict[str, str]) -> int:
        if self.task.proc_id == 0 and self.options.command:  # the controller; elastic on lost hosts
            child = self._spawn(env, 0)
            self._watch(None, None)
            code = exit_code(child.returncode) if child.poll() is not None else 1
            self.step.end(code, f"the controller on {self.node} exited {code}")
            return code
        # a signal ends a task that only serves (salloc); else the controller may still be saving
        # through this sidecar (the time limit's SIGTERM): it stays until the controller ends
        event = self._watch(sidecar, None, signals=not self.options.command)
        if event == "sidecar":
            self.say(f"the sidecar died (exit {sidecar.exited()}):\n{sidecar.log_tail()}")
            return 1
        if event == "signal":
            return 128 + self.signals[0]
        return 0


def dies_with(parent: int) -> Callable[[], None]:
    """Run in the trainer before it starts: it gets SIGKILL when `parent` (this task) ends, even
    killed outright (an OOM kill leaves no time to stop it), so no trainer outlives its task."""

    def arm() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the task ended before the line above
            os._exit(1)

    return arm


class _Stopped(Exception):
    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def _ended_code(step: StepDir) -> int:
    ended = step.ended()
    return 0 if ended is None else int(ended["code"])


def run(options: RunOptions) -> int:
    """The entry point of `colocar slurm run`: this task, from the SLURM_* variables."""
    return Supervisor(SlurmTask.from_env(), options).run()
