"""A live Slurm cluster on this one machine for tests: munged, slurmctld and several slurmd.

Everything (munge key and socket, slurm.conf, state, spool, pid and log files) lives under one
root folder; the daemons listen on free ports of 127.0.0.1, so the cluster touches nothing of the
machine's own Slurm or munge. The nodes node1..nodeN all are this host (their names do not
resolve; their NodeAddr is 127.0.0.1), as /work/shared/notes/slurm-local.md describes.
"""

from __future__ import annotations

import contextlib
import getpass
import glob
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil

SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "salloc", "scontrol", "sinfo", "squeue", "scancel")
MUNGE_BINARIES = ("munged", "munge", "unmunge")
# The processes a LiveSlurm starts (slurmctld forks slurmscriptd; slurmd forks slurmstepd per step).
DAEMONS = frozenset({"slurmctld", "slurmscriptd", "slurmd", "slurmstepd", "munged"})
TERMINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
    }
)
_SBIN = "/usr/sbin:/sbin"  # Debian puts the daemons there, off a normal user's PATH


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=_SBIN)


def slurm_missing() -> str | None:
    """None when this machine can run a LiveSlurm, else why not (which Debian package to install)."""
    parts = []
    for package, names in (("slurm-wlm", SLURM_BINARIES), ("munge", MUNGE_BINARIES)):
        missing = [name for name in names if _which(name) is None]
        if missing:
            parts.append(f"Debian's {package} (missing: {', '.join(missing)})")
    if parts:
        it = "them" if len(parts) > 1 else "it"
        return "needs " + " and ".join(parts) + f"; .ci/run installs {it} with apt-get"
    if os.geteuid() != 0:
        return "needs root: slurmd runs the jobs and switches to their user"
    return None


def _free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on 127.0.0.1 now (all held open while picking)."""
    held = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            held.append(s)
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return f"--- {path.name} ---\n" + "\n".join(text[-lines:])


class SlurmCommandError(subprocess.CalledProcessError):
    """A client command failed; its message carries the command's stderr."""

    def __str__(self) -> str:
        return f"{shlex.join(self.cmd)} failed with exit {self.returncode}: {(self.stderr or '').strip()}"


class LiveSlurm:
    """munged, slurmctld and `nodes` slurmd (node1..nodeN) as children of this process.

    `start()` returns once `sinfo` shows every node idle; `stop()` cancels the jobs, shuts the
    daemons down and kills whatever is left (idempotent). Use `env` for client commands.
    """

    def __init__(self, root: Path, nodes: int = 4) -> None:
        self.root = Path(root).resolve()
        self.node_names = [f"node{k}" for k in range(1, nodes + 1)]
        self.conf = self.root / "etc" / "slurm.conf"
        self.munge_dir = self.root / "munge"
        self.munge_socket = self.munge_dir / "munge.socket"
        self.munge_pid_file = self.munge_dir / "munged.pid"
        self.logs = self.root / "log"
        self._daemons: dict[str, subprocess.Popen[bytes]] = {}
        self._state = "new"  # new -> started -> stopped

    def __enter__(self) -> LiveSlurm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- start ------------------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> LiveSlurm:
        """Starts munged, slurmctld and the slurmd; waits until every node is idle."""
        if self._state != "new":
            raise RuntimeError(f"this LiveSlurm is {self._state}; make a new one")
        self._state = "started"
        try:
            for folder in ("etc", "state", "run", "log", *(f"spool/{n}" for n in self.node_names)):
                (self.root / folder).mkdir(parents=True, exist_ok=True)
            self._start_munged()
            ports = _free_ports(1 + len(self.node_names))
            self.conf.write_text(self.conf_text(ports[0], ports[1:]))
            self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
            for name in self.node_names:
                self._spawn(name, ["slurmd", "-D", "-f", str(self.conf), "-N", name])
            self.wait_nodes_idle(timeout)
        except Exception as error:
            logs = self.log_tail()
            self.stop()
            raise RuntimeError(f"the live Slurm under {self.root} did not start: {error}\n{logs}") from error
        except BaseException:
            self.stop()
            raise
        return self

    def _start_munged(self) -> None:
        """munged with a key, socket, pid, log and seed file of its own; it daemonizes once ready."""
        self.munge_dir.mkdir(parents=True, exist_ok=True)
        self.munge_dir.chmod(0o755)  # munged wants its socket's folder executable by all
        key = self.munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        command = [
            _which("munged") or "munged",
            f"--socket={self.munge_socket}",
            f"--key-file={key}",
            f"--pid-file={self.munge_pid_file}",
            f"--log-file={self.logs / 'munged.log'}",
            f"--seed-file={self.munge_dir / 'munged.seed'}",
            "--force",  # tmp folders above the socket are not executable by all (pytest's are 0700)
        ]
        done = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"munged failed (exit {done.returncode}): {done.stderr.strip()}")
        check = f"{_which('munge')} -S {self.munge_socket} -n | {_which('unmunge')} -S {self.munge_socket}"
        probe = subprocess.run(check, shell=True, capture_output=True, text=True, timeout=30)
        if probe.returncode != 0:
            raise RuntimeError(f"munge round trip failed: {probe.stdout}{probe.stderr}")

    def conf_text(self, controller_port: int, node_ports: list[int]) -> str:
        """slurm.conf: every path under root, the given ports, the nodes all on 127.0.0.1."""
        host = socket.gethostname().split(".")[0]
        r = self.root
        lines = [
            "ClusterName=colocar",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={controller_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/run/slurmctld.pid",
            f"SlurmdPidFile={r}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            f"PlugStackConfig={r}/etc/plugstack.conf",  # none: not the machine's /etc/slurm one
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "ReturnToService=2",  # a node that was down comes back when its slurmd registers
            "MailProg=/bin/true",
        ]
        for name, port in zip(self.node_names, node_ports, strict=True):
            lines.append(f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs=2")
        nodes = ",".join(self.node_names)
        lines.append(f"PartitionName=debug Nodes={nodes} Default=YES MaxTime=INFINITE OverSubscribe=FORCE:4")
        return "\n".join(lines) + "\n"

    def _spawn(self, name: str, command: list[str]) -> None:
        command = [_which(command[0]) or command[0], *command[1:]]
        with open(self.logs / f"{name}.out", "ab") as out:
            self._daemons[name] = subprocess.Popen(
                command, env=self.env, stdout=out, stderr=subprocess.STDOUT, cwd=self.root
            )  # cwd: slurmstepd keeps slurmd's, which is how leftover_processes() knows it

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of every daemon's log (for error messages)."""
        return "\n".join(t for p in sorted(self.logs.glob("*")) if (t := _tail(p, lines)))

    # --- client commands --------------------------------------------------------------------------
    @property
    def env(self) -> dict[str, str]:
        """os.environ with SLURM_CONF set to this cluster's and no inherited SLURM_*/SLURMD_* variable."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_"))}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def run(self, args: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        """Runs a client command against this cluster; raises SlurmCommandError (with stderr) on failure."""
        kw.setdefault("env", self.env)
        kw.setdefault("timeout", 120)
        done = subprocess.run(args, text=True, capture_output=True, check=False, **kw)
        if done.returncode != 0:
            raise SlurmCommandError(done.returncode, args, done.stdout, done.stderr)
        return done

    def sbatch(self, script: Path | str, env: dict[str, str] | None = None, args: Any = ()) -> int:
        """Submits `script` (a path); `env` adds variables to the job's environment. Returns the job id."""
        full = {**self.env, **(env or {})}
        done = self.run(["sbatch", "--parsable", *args, str(script)], env=full)
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int | str) -> dict[str, str]:
        """`scontrol show job -o` as key/value pairs (a value with spaces, as Command's, stays whole)."""
        line = self.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout.strip()
        fields = re.split(r"\s+(?=[A-Za-z][\w:/.]*=)", line)
        return dict(field.split("=", 1) for field in fields if "=" in field)

    def wait_job(self, job_id: int | str, timeout: float = 300.0) -> str:
        """Polls until the job's state is terminal (COMPLETED, FAILED, CANCELLED, ...) and returns it."""
        deadline = time.monotonic() + timeout
        while True:
            record = self.job(job_id)
            state = record.get("JobState", "")
            if state in TERMINAL_STATES:
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {state} after {timeout} s: {record}")
            time.sleep(0.2)

    def node_states(self) -> dict[str, str]:
        """Each node's short state as sinfo reports it (idle, alloc, down*, ...)."""
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_nodes_idle(self, timeout: float = 60.0) -> None:
        """Polls until sinfo shows every node idle; fails early if a daemon exited."""
        deadline = time.monotonic() + timeout
        states: dict[str, str] | str = {}
        while True:
            dead = [name for name, p in self._daemons.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"daemons exited: {dead}")
            try:
                states = self.node_states()
            except (SlurmCommandError, subprocess.TimeoutExpired) as error:
                states = str(error)  # the controller may not listen yet
            if isinstance(states, dict) and all(states.get(n) == "idle" for n in self.node_names):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"nodes not all idle after {timeout} s: {states}")
            time.sleep(0.25)

    # --- stop -------------------------------------------------------------------------------------
    def stop(self, timeout: float = 60.0) -> None:
        """Cancels the jobs, shuts the daemons down, then kills what is left (munged last). Idempotent."""
        if self._state != "started":
            self._state = "stopped"
            return
        self._state = "stopped"
        steps = self._stepds()
        controller = self._daemons.get("slurmctld")
        if controller is not None and controller.poll() is None:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                self._cancel_all_jobs(timeout / 2)
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                self.run(["scontrol", "shutdown"], timeout=15)
        deadline = time.monotonic() + timeout / 2
        for process in self._daemons.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
        for process in self._daemons.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        self._kill_trees([*steps, *self._stepds()])
        self._stop_munged()
        self._kill_trees(self.leftover_processes())

    def _cancel_all_jobs(self, timeout: float) -> None:
        """Cancels every job; after a short grace SIGKILLs the jobs' processes (KillWait is 30 s)."""
        self.run(["scancel", "--user", getpass.getuser()], timeout=15)
        if self._wait_no_jobs(5.0):
            return
        for step in self._stepds():  # their tasks, not slurmstepd itself: it then ends the job
            with contextlib.suppress(psutil.Error):
                self._kill_trees(step.children(recursive=True))
        self._wait_no_jobs(timeout)

    def _wait_no_jobs(self, timeout: float) -> bool:
        """Whether squeue shows no job (pending, running or completing) within `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.run(["squeue", "-h", "-o", "%i"], timeout=15).stdout.strip():
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.25)

    def _stop_munged(self) -> None:
        """Ends the munged named in the pid file, if it is ours (its command line names root)."""
        try:
            pid = int(self.munge_pid_file.read_text().strip())
            process = psutil.Process(pid)
            if str(self.root) not in " ".join(process.cmdline()):
                return
            process.terminate()
            psutil.wait_procs([process], timeout=10)
            if process.is_running():
                process.kill()
        except (OSError, ValueError, psutil.Error):
            pass

    def _stepds(self) -> list[psutil.Process]:
        """The slurmstepd processes of this cluster (they keep slurmd's cwd, root; their parent is init)."""
        return [p for p in self.leftover_processes() if p.info["name"] == "slurmstepd"]

    @staticmethod
    def _kill_trees(processes: list[psutil.Process]) -> None:
        """SIGKILLs each process and all its descendants (a job's tasks outlive a killed slurmstepd)."""
        doomed: dict[int, psutil.Process] = {}
        for process in processes:
            with contextlib.suppress(psutil.Error):
                for p in [process, *process.children(recursive=True)]:
                    doomed[p.pid] = p
        for p in doomed.values():
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGKILL)
        psutil.wait_procs(list(doomed.values()), timeout=10)

    def leftover_processes(self) -> list[psutil.Process]:
        """Live Slurm daemons (DAEMONS) and munged of this cluster (their cmdline or cwd names root)."""
        named = re.compile(re.escape(str(self.root)) + r"(/|\s|$)")  # root itself, not root's siblings
        found = []
        for process in psutil.process_iter(["name", "cmdline", "cwd", "status"]):
            info = process.info
            if info["name"] not in DAEMONS or info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if named.search(" ".join(info["cmdline"] or ())) or named.match(info["cwd"] or ""):
                found.append(process)
        return found


def job_processes(job: int) -> list[psutil.Process]:
    """Every live process of Slurm job `job` (its environment says so), slurmstepd aside."""
    found = []
    for p in psutil.process_iter(["name", "status"]):
        with contextlib.suppress(psutil.Error):
            if p.info["name"] != "slurmstepd" and p.info["status"] != psutil.STATUS_ZOMBIE:
                if p.environ().get("SLURM_JOB_ID") == str(job):
                    found.append(p)
    return found


def assert_job_left_nothing(job: int, paths: tuple[Path, ...] = (), timeout: float = 60.0) -> None:
    """No process of the job, no /dev/shm file or folder of it, none of `paths` (in `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        processes = job_processes(job)
        files = [*glob.glob(f"/dev/shm/colocar-slurm{job}-*"), *(str(p) for p in paths if p.exists())]
        if not processes and not files:
            return
        with contextlib.suppress(psutil.Error):
            assert time.monotonic() < deadline, (
                f"left by job {job}: {[(p.pid, p.cmdline()[:4]) for p in processes]}, files {files}"
            )
        time.sleep(0.5)
