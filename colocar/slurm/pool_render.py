"""`colocar slurm render --pool`: the sbatch script of a long-running shared pool, as text.

One task per node runs `colocar slurm pool-task` (`pool.py`): the node's pool node daemon,
and on the first node the pool's agent, which writes `DIR/pool.json`. The job holds its nodes
(`--exclusive`) for the tenants, whose job steps run in its allocation with `srun
--jobid=<pool job id> --overlap` and connect with `colocar.connect(pool="DIR/pool.json")`
(`tenant_step` says how; render prints it on stderr). The tenants file is checked here, so a
bad one is refused before the job waits in the queue.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field

from colocar.pool.tenants import TenantsFileError, parse
from colocar.sizes import parse_size

from .task import SlurmError

DEFAULT_POOL_DIR = "${COLOCAR_JOB_DIR:-$HOME/.colocar/slurm/<pool job id>}"


@dataclass(frozen=True)
class PoolScriptOptions:
    nodes: int
    tenants: str | None
    pool_dir: str | None = None  # default: the job directory
    capacity: str = "1G"
    max_tenants: int = 8
    idle_seconds: float = 60.0
    job_name: str = "colocar-pool"
    python: str = field(default_factory=lambda: sys.executable)
    sbatch: tuple[str, ...] = ()

    def check(self) -> PoolScriptOptions:
        if self.nodes < 1:
            raise SlurmError(f"--nodes {self.nodes}: at least 1")
        if not self.tenants:
            raise SlurmError("--pool needs --tenants FILE: the tenants file (YAML) naming who may use it")
        check_tenants(self.tenants)
        try:
            parse_size(self.capacity)
        except ValueError as e:
            raise SlurmError(f"--capacity: {e}") from None
        if self.max_tenants < 1:
            raise SlurmError(f"--max-tenants {self.max_tenants}: at least 1")
        if self.idle_seconds <= 0:
            raise SlurmError(f"--idle-seconds {self.idle_seconds}: more than 0")
        return self


def check_tenants(path: str) -> None:
    """Refuses a tenants file that the pool's agent would refuse (its token files too)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise SlurmError(f"--tenants {path}: {e.strerror}") from None
    try:
        parse(text, os.path.dirname(os.path.abspath(path)))
    except TenantsFileError as e:
        raise SlurmError(f"--tenants {path}: {e}") from None


def pool_file(o: PoolScriptOptions) -> str:
    return os.path.join(os.path.abspath(o.pool_dir) if o.pool_dir else DEFAULT_POOL_DIR, "pool.json")


def tenant_step(o: PoolScriptOptions) -> str:
    """How a tenant's job runs on the pool's nodes (what render prints on stderr)."""
    return (
        "colocar slurm render: once the pool job runs, tenants run their job steps in its allocation:\n"
        f"  srun --jobid=<pool job id> --overlap -N {o.nodes} --ntasks-per-node=1 python train.py\n"
        f'  with colocar.connect(pool="{pool_file(o)}", token_file="<the tenant\'s token file>")\n'
        "  (each process of a multi-controller job gets the sidecar on its own node)\n"
    )


def _header(o: PoolScriptOptions, argv: list[str]) -> list[str]:
    lines = [
        "#!/bin/bash",
        f"# Rendered by: colocar slurm render {shlex.join(argv)}",
        "# Submit: sbatch THIS_FILE. Tenants run their steps in this job's allocation:",
        f"#   srun --jobid=<this job's id> --overlap -N {o.nodes} --ntasks-per-node=1 python train.py",
        f'#   with colocar.connect(pool="{pool_file(o)}", token_file=...)',
        "# Stop: scancel <this job's id> (the tenants' sidecars stop, the pool file is removed).",
        f"#SBATCH --job-name={o.job_name}",
        f"#SBATCH --nodes={o.nodes}",
        "#SBATCH --ntasks-per-node=1     # one task per node: its pool node (and on the first, the agent)",
        "#SBATCH --exclusive             # the nodes are the tenants': their steps run in this allocation",
    ]
    return lines + [f"#SBATCH {line}" for line in o.sbatch]


def render_pool(o: PoolScriptOptions, argv: list[str]) -> str:
    """The whole script; `argv` (the render command's own) is recorded in its header."""
    o.check()
    assert o.tenants is not None
    task = [o.python, "-m", "colocar", "slurm", "pool-task", "--tenants", os.path.abspath(o.tenants)]
    task += ["--capacity", o.capacity, "--max-tenants", str(o.max_tenants)]
    task += ["--idle-seconds", f"{o.idle_seconds:g}"]
    if o.pool_dir:
        task += ["--pool-dir", os.path.abspath(o.pool_dir)]
    body = [
        "set -euo pipefail",
        "# The job's directory (0700): the node and admin tokens (0600), the daemons' logs and, by",
        "# default, pool.json. --pool-dir puts pool.json where the tenants can read it.",
        'export COLOCAR_JOB_DIR="${COLOCAR_JOB_DIR:-$HOME/.colocar/slurm/$SLURM_JOB_ID}"',
        "trap 'rm -rf \"$COLOCAR_JOB_DIR\"' EXIT",
        "# scancel: srun's tasks stop the pool first; this shell waits for them, then cleans up.",
        "trap 'echo \"colocar pool: stopping\" >&2' TERM INT",
        "# --overlap: the tenants' steps share the nodes with this one.",
        "srun --ntasks-per-node=1 --overlap --kill-on-bad-exit=0 --cpu-bind=none \\",
        f"    {shlex.join(task)}",
    ]
    return "\n".join(_header(o, argv) + body) + "\n"
