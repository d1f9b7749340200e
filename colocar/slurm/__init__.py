"""Slurm: `colocar slurm render` prints a job's sbatch script; `colocar slurm run`, under srun,
runs each node's sidecar and its trainer (or one controller), restarts trainers in place, and
publishes the sidecars in the job's directory for `colocar.connect()` (README: Run on Slurm).
"""

from .render import ScriptOptions, render
from .supervisor import RunOptions
from .task import SlurmError, SlurmTask

__all__ = ["RunOptions", "ScriptOptions", "SlurmError", "SlurmTask", "render"]
