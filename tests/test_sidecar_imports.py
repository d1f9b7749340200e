"""The modules a sidecar and its workers run import no JAX: a sidecar-side import of JAX costs
each writer, keeper or pipeline worker ~3 s of start-up and ~90 MiB of memory (it happened once
through a controller-side import in a module the checkpoint writer shares). Nor
prometheus_client: a sidecar loads it only for its --metrics-port endpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers import program

REPO = Path(__file__).resolve().parent.parent
SIDECAR_SIDE = (
    "colocar.sidecar.server",
    "colocar.sidecar.worker_main",
    "colocar.checkpoint.backends.writer",
    "colocar.checkpoint.backends.reader",
    "colocar.checkpoint.backends.fencing",
    "colocar.elastic.snapshots.keepers.keeper",
    "colocar.elastic.snapshots.keepers.multi",
    "colocar.loaders.host_backend",
    "colocar.loaders.pump",
    "colocar.loaders.worker",
)


def test_sidecar_side_modules_import_no_jax() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = [sys.executable, program("imports_without_jax"), "assert", *SIDECAR_SIDE]
    done = subprocess.run(run, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
