"""A single controller that saves a last checkpoint when Slurm signals the job's tasks before
its time limit (`--signal=TERM@S` in the rendered script; tests/test_slurm_jobs.py). argv: the
checkpoint directory.

It trains until `reached_preemption()`, saves that step, waits for the commit, prints
"SAVED <step>" and exits 0, while its task still runs every node's sidecar.
"""

import os
import sys
import time

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import colocar  # noqa: E402
from colocar.checkpoint import CheckpointManager  # noqa: E402

with colocar.connect() as cluster, CheckpointManager(sys.argv[1], cluster, save_on_preemption=True) as mngr:
    sharding = jax.sharding.NamedSharding(cluster.mesh("data"), jax.sharding.PartitionSpec("data"))
    state = jax.device_put(jnp.zeros(len(jax.devices()) * 4, jnp.float32), sharding)
    step = 0
    while not mngr.reached_preemption(step):
        state = state + 1
        step += 1
        print("training", step, flush=True)
        time.sleep(0.2)
    mngr.save(step, {"state": state})
    mngr.wait()
    print("SAVED", step, flush=True)
