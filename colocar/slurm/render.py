"""`colocar slurm render`: the sbatch script of a job, as text.

One task per node runs `colocar slurm run` (the node's sidecar, and the trainer or, on the
first node of a single-controller job, the controller). The header keeps an elastic job
alive where colocar recovers (`--no-kill`, `srun --kill-on-bad-exit=0`), queues a preempted
job again (`--requeue`, `--open-mode=append`), and signals every task `--signal-seconds`
before the time limit (`--signal=TERM@S`): the trainer's `save_on_preemption` then saves a
last step while its sidecar still runs.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field

from colocar.sizes import parse_size

from .task import SlurmError

TOPOLOGIES = ("multi", "single")


@dataclass(frozen=True)
class ScriptOptions:
    nodes: int
    command: list[str]
    topology: str = "multi"
    arena: str = "16G"
    trainer_restarts: int = 0
    job_name: str = "colocar"
    signal_seconds: int = 120
    python: str = field(default_factory=lambda: sys.executable)
    sbatch: tuple[str, ...] = ()  # more #SBATCH lines: --partition=..., --time=..., --gpus-per-node=8

    def check(self) -> ScriptOptions:
        if self.nodes < 1:
            raise SlurmError(f"--nodes {self.nodes}: at least 1")
        if self.topology not in TOPOLOGIES:
            raise SlurmError(f"--topology {self.topology!r}: one of {', '.join(TOPOLOGIES)}")
        if self.trainer_restarts < 0:
            raise SlurmError(f"--trainer-restarts {self.trainer_restarts} must be 0 or more")
        if self.trainer_restarts and self.topology == "single":
            raise SlurmError(
                "--trainer-restarts restarts multi-controller trainers in place; a single "
                "controller recovers lost hosts itself (colocar.elastic): use --topology multi"
            )
        if not self.command:
            raise SlurmError("give the command after --: colocar slurm render --nodes N -- python train.py")
        try:
            parse_size(self.arena)
        except ValueError as e:
            raise SlurmError(f"--arena: {e}") from None
        return self


def _header(o: ScriptOptions, argv: list[str]) -> list[str]:
    lines = [
        "#!/bin/bash",
        f"# Rendered by: colocar slurm render {shlex.join(argv)}",
        "# Submit: sbatch THIS_FILE (README: Run on Slurm)",
        f"#SBATCH --job-name={o.job_name}",
        f"#SBATCH --nodes={o.nodes}",
        "#SBATCH --ntasks-per-node=1     # one task per node: its sidecar and its trainer",
        "#SBATCH --exclusive             # the node's CPUs and memory: trainer, sidecar, input pipeline",
        "#SBATCH --no-kill               # a lost node does not end the job: colocar recovers on the others",
        "#SBATCH --requeue               # preempted: queued again, resuming from the newest checkpoint",
        "#SBATCH --open-mode=append      # a requeued job appends to its output",
        f"#SBATCH --signal=TERM@{o.signal_seconds}        # every task, before the time limit: the last save",
    ]
    return lines + [f"#SBATCH {line}" for line in o.sbatch]


def render(o: ScriptOptions, argv: list[str]) -> str:
    """The whole script; `argv` (the render command's own) is recorded in its header."""
    o.check()
    run = [o.python, "-m", "colocar", "slurm", "run", "--topology", o.topology, "--arena", o.arena]
    if o.trainer_restarts:
        run += ["--trainer-restarts", str(o.trainer_restarts)]
    body = [
        "set -euo pipefail",
        "# The job's directory, on a file system every node sees: the token (0600), each node's",
        "# sidecar address, connection.json (what colocar.connect() reads), the sidecars' logs.",
        'export COLOCAR_JOB_DIR="${COLOCAR_JOB_DIR:-$HOME/.colocar/slurm/$SLURM_JOB_ID}"',
        "trap 'rm -rf \"$COLOCAR_JOB_DIR\"' EXIT",
        "# --kill-on-bad-exit=0: a task that fails (a lost node) leaves the others running.",
        "srun --ntasks-per-node=1 --kill-on-bad-exit=0 --cpu-bind=none \\",
        f"    {shlex.join(run)} -- \\",
        f"    {shlex.join(o.command)}",
    ]
    return "\n".join(_header(o, argv) + body) + "\n"
