"""Elastic training under `colocar slurm run` (tests/test_slurm_jobs.py), in either topology.

argv: the checkpoint directory, the step after which a loss happens, what is lost ("sidecar"
or "trainer"). Single-controller (one process reaching every node's sidecar): the third
node's sidecar is killed then (`colocar.elastic.faults`) and the run goes on on the
survivors, from their RAM. Multi-controller (`jax.distributed`, one process per node), in the
first run: the second process's trainer kills itself (SIGKILL), or its own sidecar is killed
(the trainer then exits); `colocar slurm run` starts a dead sidecar again (empty), restarts
every node's trainer in place, and they resume from the sidecars' RAM, the empty one refilled
from its peer's replicas. Every step checks that its batch holds the
records the sampler gives for that step (the record stream exact); the last line, "RESULT
<json>", says where the run restored from and how far the state is from an uninterrupted run.
"""

import json
import os
import signal
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # elastic_helpers

import jax  # noqa: E402
import numpy as np  # noqa: E402
from elastic_helpers import B, N, abstract, config, init, mesh_of, plain_run, to_numpy, train_step  # noqa: E402

MULTI = "JAX_COORDINATOR_ADDRESS" in os.environ  # set by `colocar slurm run --topology multi`
if MULTI:
    jax.distributed.initialize()  # the process id and count: JAX's own Slurm detection

import colocar  # noqa: E402
from colocar.checkpoint import CheckpointManager  # noqa: E402
from colocar.loaders.sampler import IndexSampler  # noqa: E402

directory, loss_step, lost = sys.argv[1], int(sys.argv[2]), sys.argv[3]
TOTAL = 12
RESTART = int(os.environ.get("COLOCAR_RESTART", "0"))  # this trainer's restarts in place

cluster = colocar.connect()
FIRST_RUN_OF_1 = MULTI and RESTART == 0 and jax.process_index() == 1
if not MULTI:
    faults = [colocar.elastic.faults.kill(2, at_step=loss_step)]  # the third node's sidecar
else:  # under multi-controller a fault acts on this process's own sidecar: host 0 of its cluster
    faults = (
        [colocar.elastic.faults.kill(0, at_step=loss_step)] if FIRST_RUN_OF_1 and lost == "sidecar" else []
    )
checkpoints = CheckpointManager(directory, cluster)
elastic = colocar.elastic.Manager(
    cluster, checkpoints=checkpoints, snapshot_every=1, save_every=100, faults=faults
)
sampler = IndexSampler(N, B, seed=3)


def check_records(batch: dict, step: int) -> None:
    """This process's rows of the batch are the sampler's records of `step`, in order."""
    want = sampler.batch_indices(step)
    for shard in batch["index"].addressable_shards:
        assert np.array_equal(np.asarray(shard.data), want[shard.index]), (step, shard.index)


@elastic.run(min_hosts=1)
def train(hosts, devices):
    mesh = mesh_of(colocar.elastic.devices_for_batch(devices, B))
    state, start = elastic.restore(abstract(mesh), init=lambda: init(mesh))
    it = elastic.load(config(), mesh)
    for step in range(start, TOTAL):
        batch = next(it)
        check_records(batch, step)
        state, _ = train_step(state, batch)
        elastic.step(step, {"state": state, "data": it})
        if FIRST_RUN_OF_1 and lost == "trainer" and step == loss_step:
            os.kill(os.getpid(), signal.SIGKILL)  # a lost trainer, mid-run
    it.close()
    return state, start, len(hosts)


try:
    state, first, hosts = train()
except colocar.elastic.ElasticError as e:  # multi: this trainer must exit, to be restarted
    print("ELASTIC", e, flush=True)
    os._exit(1)  # no jax.distributed shutdown barrier: a peer is stuck in a collective
local = [jax.local_devices()[0]]
reference = plain_run(local, init(mesh_of(local)), 0, TOTAL)[0][TOTAL]
got = to_numpy(state)
gap = max(
    float(np.max(np.abs(a - b)))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(reference), strict=True)
)
stats = elastic.stats()
result = {
    "process": jax.process_index(),
    "restart": RESTART,
    "first_step": first,
    "hosts": hosts,
    "restored_from": stats["restored_from"],
    "counts": {k: v for k, v in stats["counts"].items() if v},
    "gap": gap,
}
elastic.close()
cluster.close()
print("RESULT", json.dumps(result), flush=True)
