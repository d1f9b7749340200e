"""This task of a Slurm job step, from the variables `srun` sets, and the node addresses.

Runs in `colocar slurm run` (no JAX). One task per node: the node's sidecar and, under
multi-controller JAX, its trainer. Node names need not resolve (a cluster may route by
`NodeAddr`), so a node's address is its `NodeAddr` as `scontrol` reports it, or the name.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from colocar.errors import ColocarError

# What srun sets in every task of a step (the batch script itself has no SLURM_STEP_NODELIST).
_REQUIRED = (
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_NODEID",
    "SLURM_STEP_NUM_NODES",
    "SLURMD_NODENAME",
    "SLURM_STEP_NODELIST",
)


class SlurmError(ColocarError):
    """`colocar slurm` cannot run here as asked; the message says what to change."""


@dataclass(frozen=True)
class SlurmTask:
    """One task of an srun step: `proc_id` of `ntasks`, on node `node_id` (`node_name`) of
    the step's `nodes` nodes (`nodelist`, Slurm's compressed form); a requeued job runs its
    steps again under the same ids, `restart_count` tells the runs apart."""

    job_id: int
    step_id: str
    proc_id: int
    ntasks: int
    node_id: int
    nodes: int
    node_name: str
    nodelist: str
    restart_count: int = 0  # how many times Slurm requeued the job

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SlurmTask:
        env = os.environ if environ is None else environ
        missing = [name for name in _REQUIRED if not env.get(name)]
        if missing:
            raise SlurmError(
                "colocar slurm run must run as a task of a job step, under srun (e.g. "
                "`srun --ntasks-per-node=1 colocar slurm run -- python train.py` in an sbatch "
                f"script or an salloc shell); not set here: {', '.join(missing)}"
            )
        task = cls(
            job_id=int(env["SLURM_JOB_ID"]),
            step_id=env["SLURM_STEP_ID"],
            proc_id=int(env["SLURM_PROCID"]),
            ntasks=int(env["SLURM_NTASKS"]),
            node_id=int(env["SLURM_NODEID"]),
            nodes=int(env["SLURM_STEP_NUM_NODES"]),
            node_name=env["SLURMD_NODENAME"],
            nodelist=env["SLURM_STEP_NODELIST"],
            restart_count=int(env.get("SLURM_RESTART_COUNT") or 0),
        )
        if task.ntasks != task.nodes:
            raise SlurmError(
                f"colocar slurm run wants one task per node, got {task.ntasks} tasks on "
                f"{task.nodes} nodes: run it with `srun --ntasks-per-node=1`"
            )
        return task


def _scontrol(*args: str) -> str:
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        raise SlurmError("scontrol is not on PATH: colocar slurm reads node addresses with it")
    done = subprocess.run([scontrol, *args], capture_output=True, text=True, timeout=60)
    if done.returncode:
        raise SlurmError(f"scontrol {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def hostnames(nodelist: str) -> list[str]:
    """Slurm's compressed node list ('node[1-3,7]') as names, in Slurm's order."""
    return _scontrol("show", "hostnames", nodelist).split()


def node_address(name: str) -> str:
    """How the other nodes reach node `name`: its `NodeAddr` (the name when Slurm has none)."""
    for field in _scontrol("show", "node", "-o", name).split():
        key, _, value = field.partition("=")
        if key == "NodeAddr" and value:
            return value
    return name
