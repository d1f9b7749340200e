"""One of two JAX processes running the elastic Manager's loop over a global mesh, each on its
own sidecar: snapshots every step, a storage save every 3, data from a real loader.

Run by test_elastic_manager_multi.py; argv as in ckpt_processes.py (the directory holds the
checkpoints), then the mode: "train" (from init, steps 0..6, then waits for the saves, prints
"ready <json>" and waits on stdin to be killed), "resume" (restores, checks the state bit for
bit against the state computed from the data, runs to step 12, prints "OK <json>": the step and
tier it restored from, the events counted) or "lose" (process 1's own sidecar is killed after
step 4: it prints "ELASTIC <json>", the error and the events, and exits; process 0, in a
collective, is killed by the test) or "fail" (both raise a RuntimeError of their own before
step 5, inside `with elastic:`) or "stall" (process 1 prints "stalled" once its Manager is
made and waits on stdin to be killed; process 0 prints "waiting" and restores, an exchange
process 1 never joins: it prints "ELASTIC <json>" and exits once it notices process 1 is
gone). An optional last argument:
snapshot every that many steps (default 1). Saves of a step just snapshotted come from the
snapshot's blocks; "train" reports where each save came from.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
# the transforms come from loaders_helpers; the sidecars get this sys.path when we connect
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from ckpt_processes import start  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from loaders_helpers import config, expected_labels  # noqa: E402

process, cluster, directory = start(heartbeat_seconds=3.0)  # a busy test machine misses 1 s beats
mode = sys.argv[6]
SNAPSHOT_EVERY = int(sys.argv[7]) if len(sys.argv) > 7 else 1
TRAIN_STEPS, TOTAL = 7, 12  # the loader's 100 records in batches of 16, 2 epochs: 12 batches

import colocar  # noqa: E402
from colocar.checkpoint import CheckpointManager  # noqa: E402

CFG = config(batch_axes=["data"])
SPECS = {"w": P("data", "model"), "b": P(), "v": P("model"), "acc": P()}
W0 = np.random.default_rng(7).integers(-1000, 1000, (64, 16)).astype(np.float32)
B0 = np.arange(8, dtype=np.float32)
V0 = np.random.default_rng(8).integers(0, 1000, (6,)).astype(np.int32)


def expected(step: int) -> dict:
    """The state after `step` steps, exactly (integer-valued float32 updates are exact); `acc`
    sums the labels of every batch the steps read, so it checks the data position too."""
    acc = sum(sum(expected_labels(k)) for k in range(step))
    return {
        "w": W0 + step * (step + 1) / 2,
        "b": B0 * 2.0**step,
        "v": V0 + step,
        "acc": np.asarray(acc, np.int32),
    }


def shardings(mesh: Mesh) -> dict:
    return {k: NamedSharding(mesh, spec) for k, spec in SPECS.items()}


def init(mesh: Mesh) -> dict:
    want = expected(0)
    return {
        k: jax.make_array_from_callback(want[k].shape, s, want[k].__getitem__)
        for k, s in shardings(mesh).items()
    }


def target(mesh: Mesh) -> dict:
    want = expected(0)
    return {
        k: jax.ShapeDtypeStruct(want[k].shape, want[k].dtype, sharding=s) for k, s in shardings(mesh).items()
    }


@jax.jit
def train_step(state: dict, labels: jax.Array, step: int) -> dict:
    return {
        "w": state["w"] + step,
        "b": state["b"] * 2.0,
        "v": state["v"] + 1,
        "acc": state["acc"] + jnp.sum(labels).astype(jnp.int32),
    }


def check(state: dict, step: int, mesh: Mesh) -> None:
    want = expected(step)
    for key, sharding in shardings(mesh).items():
        assert state[key].sharding == sharding, (key, state[key].sharding)
        for shard in state[key].addressable_shards:
            got, ref = np.asarray(shard.data), want[key][shard.index]
            assert got.dtype == ref.dtype and got.tobytes() == ref.tobytes(), (key, step, shard.index)


def check_batch(batch: dict, k: int) -> None:
    """This process's rows of batch `k` are the sampler's records of batch `k`."""
    want = np.asarray(expected_labels(k), np.int32)
    for shard in batch["label"].addressable_shards:
        assert np.array_equal(np.asarray(shard.data), want[shard.index]), (k, shard.index)


checkpoints = CheckpointManager(directory, cluster, max_chunk_bytes=1 << 20, commit_timeout=30)
# "lose": process 1's own sidecar is killed once step 4 is done (its snapshot and save started)
faults = [colocar.elastic.faults.kill(0, at_step=4)] if mode == "lose" and process == 1 else []
elastic = colocar.elastic.Manager(
    cluster, checkpoints=checkpoints, snapshot_every=SNAPSHOT_EVERY, save_every=3, faults=faults
)
stop = TRAIN_STEPS if mode == "train" else TOTAL
if mode == "stall":
    print("stalled" if process == 1 else "waiting", flush=True)
    if process == 1:
        sys.stdin.readline()  # killed here
        sys.exit(3)


@elastic.run(min_hosts=1)
def train(hosts, devices):
    assert len(devices) == 8 and len(hosts) == 1, (hosts, devices)  # every process's devices
    mesh = Mesh(np.array(devices).reshape(4, 2), ("data", "model"))
    state, step = elastic.restore(target=target(mesh), init=lambda: init(mesh))
    check(state, step, mesh)
    first = step
    it = elastic.load(CFG, mesh)
    for s in range(step, stop):
        if mode == "fail" and s == 5:  # the snapshot of step 5 was taken
            raise RuntimeError("a bug in the training loop")
        batch = next(it)
        check_batch(batch, s)
        state = train_step(state, batch["label"], s + 1)
        elastic.step(s, {"state": state, "data": it})
    check(state, stop, mesh)
    return first


if mode == "fail":
    with elastic:  # the error propagates; the manager keeps the snapshots for the restart
        train()
try:
    first = train()
except colocar.elastic.ElasticError as e:  # "lose": this trainer must exit, to be restarted
    print("ELASTIC", json.dumps({"error": str(e), "counts": elastic.stats()["counts"]}), flush=True)
    os._exit(1)  # no jax.distributed shutdown barrier: process 0 is stuck in a collective
stats = elastic.stats()
report = {
    "step": first,
    "restored_from": stats["restored_from"],
    "counts": {k: v for k, v in stats["counts"].items() if v},
    "committed": stats.get("snapshots", {}).get("committed"),
}
report["saved_from"] = stats["checkpoints"]["saved_from"]  # how many saves: snapshot / devices
report["saves"] = [e["detail"] for e in stats["events"] if e["kind"] == "save"]
report["unusable"] = [e["detail"] for e in stats["events"] if "snapshot unusable" in e["detail"]]
if mode == "train":
    elastic.checkpoints.wait()  # the saves of steps 3 and 6 are committed
    last = elastic.checkpoints.stats()["save"]  # step 6's: bytes copied from the devices
    report["last_save"] = {k: last[k] for k in ("step", "bytes", "pieces")}
    report["saved_keys"] = sorted(elastic.checkpoints.steps.committed_manifest(6)[1]["leaves"])
    report["saved_meta"] = elastic.checkpoints.metadata(6)  # the elastic bookkeeping
    print("ready", json.dumps(report), flush=True)
    sys.stdin.readline()  # killed here
    sys.exit(3)
elastic.close()
print("OK", json.dumps(report), flush=True)
cluster.close()
