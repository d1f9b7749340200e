"""One of two JAX processes of the multi-controller soak, each on its own sidecar: the elastic
Manager's loop over a global mesh with a real loader, every batch and the state checked against
the data at every step (tests/soak_helpers.py's state, sharded over both processes).

Run by tests/test_soak.py::test_multi_controller_soak; argv as in ckpt_processes.py (the
directory holds the checkpoints), then: snapshot every K steps, save every M steps, and the
step to stop at (the soak kills the trainers before a far one). Prints "restored <json>" (step
and tier) once restored, "step S" after each `step(S)`, "ELASTIC <json>" and exits 1 when a
lost host or process ends it, and "OK <json>" (the final state's digest) at its stop step.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

import jax  # noqa: E402
import numpy as np  # noqa: E402
from ckpt_processes import start  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from loaders_helpers import config, expected_labels  # noqa: E402
from soak_helpers import expected_state, soak_step  # noqa: E402

process, cluster, directory = start(heartbeat_seconds=3.0)  # a busy test machine misses 1 s beats
SNAPSHOT_EVERY, SAVE_EVERY, STOP = (int(a) for a in sys.argv[6:9])
EPOCHS = 1000

import colocar  # noqa: E402
from colocar.checkpoint import CheckpointManager  # noqa: E402

CFG = config(batch_axes=["data"], num_epochs=EPOCHS)
SPECS = {"w": P("data", "model"), "acc": P(), "order": P(), "steps": P()}
step_fn = jax.jit(soak_step)


def batch_ids(k: int) -> list[int]:
    return expected_labels(k, num_epochs=EPOCHS)


def shardings(mesh: Mesh) -> dict:
    return {k: NamedSharding(mesh, spec) for k, spec in SPECS.items()}


def init(mesh: Mesh) -> dict:
    want = expected_state(0, batch_ids)
    return {
        k: jax.make_array_from_callback(want[k].shape, s, want[k].__getitem__)
        for k, s in shardings(mesh).items()
    }


def target(mesh: Mesh) -> dict:
    want = expected_state(0, batch_ids)
    return {
        k: jax.ShapeDtypeStruct(want[k].shape, want[k].dtype, sharding=s) for k, s in shardings(mesh).items()
    }


def check(state: dict, step: int, want: dict) -> None:
    """This process's shards of the state after `step` steps are the data's, bit for bit."""
    for key, ref in want.items():
        for shard in state[key].addressable_shards:
            got, part = np.asarray(shard.data), np.asarray(ref)[shard.index]
            assert got.dtype == part.dtype and got.tobytes() == part.tobytes(), (key, step, shard.index)


def check_batch(batch: dict, k: int) -> None:
    """This process's rows of batch `k` are the sampler's records of batch `k`."""
    want = np.asarray(batch_ids(k), np.int32)
    for shard in batch["label"].addressable_shards:
        assert np.array_equal(np.asarray(shard.data), want[shard.index]), (k, shard.index)


checkpoints = CheckpointManager(directory, cluster, max_chunk_bytes=1 << 20, commit_timeout=30, max_to_keep=3)
elastic = colocar.elastic.Manager(
    cluster, checkpoints=checkpoints, snapshot_every=SNAPSHOT_EVERY, save_every=SAVE_EVERY
)


@elastic.run(min_hosts=1)
def train(hosts, devices):
    mesh = Mesh(np.array(devices).reshape(4, 2), ("data", "model"))
    state, step = elastic.restore(target=target(mesh), init=lambda: init(mesh))
    sums = [int(np.sum(batch_ids(k))) for k in range(step)]  # the data's state, kept up per step
    check(state, step, expected_state(step, lambda k: batch_ids(k)))
    print(f"restored {json.dumps({'step': step, 'from': elastic.restored_from})}", flush=True)
    it = elastic.load(CFG, mesh)
    for s in range(step, STOP):
        batch = next(it)
        check_batch(batch, s)
        state = step_fn(state, batch["label"], np.int32(s))
        del batch
        sums.append(int(np.sum(batch_ids(s))))
        if (s + 1) % SNAPSHOT_EVERY == 0:  # each snapshot's state checked, the others cheaply
            check(state, s + 1, expected_state(s + 1, lambda k: sums[k]))
        elastic.step(s, {"state": state, "data": it})
        print(f"step {s}", flush=True)  # one write: Gloo's own lines share the pipe
    return state


try:
    final = train()
except colocar.elastic.ElasticError as e:  # a lost host or process: this trainer must exit
    print(f"ELASTIC {json.dumps({'error': str(e)[:500]})}", flush=True)
    os._exit(1)  # no jax.distributed shutdown barrier: the peer may be stuck in a collective
check(final, STOP, expected_state(STOP, batch_ids))
digest = {k: np.asarray(final[k].addressable_shards[0].data).tolist() for k in ("acc", "order", "steps")}
elastic.close()
print(f"OK {json.dumps({'stop': STOP, 'digest': digest})}", flush=True)
cluster.close()
