"""Slurm: `colocar slurm render` prints a job's sbatch script; `colocar slurm run`, under srun,
runs each node's sidecar and its trainer (or one controller), restarts trainers in place, and
publishes the sidecars in the job's directory for `colocar.connect()` (README: Run on Slurm).
`colocar slurm render --pool` prints a shared pool's job instead: `colocar slurm pool-task` runs a
pool node per node and the agent, and tenants run their steps in its allocation (`pool.py`).
"""

from .render import ScriptOptions, render
from .supervisor import RunOptions
from .task import SlurmError, SlurmTask

__all__ = ["RunOptions", "ScriptOptions", "SlurmError", "SlurmTask", "render"]
