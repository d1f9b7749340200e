"""One of the JAX processes of a multi-controller job that snapshots into its own sidecar, then,
run again with fewer processes (a host lost and not replaced), restores from the survivors'
RAM: the lost host's shards from the replicas its peer holds.

Run by test_elastic_multi.py; argv as in ckpt_processes.py (the directory unused), then the
mode and the process count: "train" (3 processes: snapshots of steps 1-3, each waited for,
prints "ready <committed>", then waits on stdin to be killed) or "resume" (2 processes:
restores the newest snapshot onto their 4 devices, checks it bit for bit, takes and restores
the next step, prints "OK <json>").
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

process, port, address, token_file = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
mode, processes = sys.argv[6], int(sys.argv[7])
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=processes, process_id=process)

import colocar  # noqa: E402
from colocar.elastic.snapshots import Snapshots  # noqa: E402

cluster = colocar.connect([address], token_file=token_file, heartbeat_seconds=3.0)
mesh = Mesh(np.array(jax.devices()), ("d",))  # 6 devices in training, 4 on resuming
SHARDINGS = {
    "w": NamedSharding(mesh, P("d")),
    "b": NamedSharding(mesh, P()),
    "h": NamedSharding(mesh, P("d")),
}
W0 = np.random.default_rng(7).integers(-1000, 1000, (12, 4)).astype(np.float32)
H0 = np.random.default_rng(9).integers(0, 100, (12, 3)).astype(jnp.bfloat16)


def expected(step: int) -> dict:
    """The state after `step` steps, exactly (integer-valued updates)."""
    return {
        "w": W0 + step,
        "b": np.arange(8, dtype=np.float32) * 2.0**step,
        "h": (H0.astype(np.float32) + step).astype(jnp.bfloat16),
    }


def make(step: int) -> dict:
    want = expected(step)
    out = {
        k: jax.make_array_from_callback(want[k].shape, s, want[k].__getitem__) for k, s in SHARDINGS.items()
    }
    return {**out, "step": step}


def check(state: dict, step: int) -> None:
    """Every addressable shard of every array, bit for bit, on this job's shardings."""
    want = expected(step)
    for key, sharding in SHARDINGS.items():
        assert state[key].sharding == sharding, (key, state[key].sharding)
        for shard in state[key].addressable_shards:
            got, ref = np.asarray(shard.data), want[key][shard.index]
            assert got.dtype == ref.dtype and got.tobytes() == ref.tobytes(), (key, step, shard.index)
    assert state["step"] == step


snaps = Snapshots(cluster, replicas=1, name="mc-shrink", replication_timeout=60)
if mode == "train":
    for step in (1, 2, 3):
        assert snaps.take(step, make(step))
        snaps.wait()
    print("ready", json.dumps(snaps.stats()["committed"]), flush=True)
    sys.stdin.readline()  # killed here
    sys.exit(3)

target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=SHARDINGS[k]) for k, v in expected(0).items()}
target["step"] = None  # type: ignore[assignment]
latest = snaps.latest()
assert latest == 3, latest  # from RAM: the lost host's shards live on as its peer's replicas
check(snaps.restore(latest, target), latest)
fetched = snaps.stats()["fetched_bytes"]
assert snaps.take(latest + 1, make(latest + 1))  # the job goes on with its new layout
snaps.wait()
assert snaps.latest() == latest + 1
refilled = snaps.stats()["refilled_bytes"]
check(snaps.restore(latest + 1, target), latest + 1)
# a snapshot waited for is complete on its peers too (before, a keeper reported "replicated"
# before its record reached them, and the restore sent every shard again)
assert snaps.stats()["refilled_bytes"] == refilled, (refilled, snaps.stats())
print(
    "OK", json.dumps({"step": latest, "fetched": fetched, "refilled_bytes": snaps.stats()["refilled_bytes"]})
)
snaps.close()
jnp.zeros(1).block_until_ready()
