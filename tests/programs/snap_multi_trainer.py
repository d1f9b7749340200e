"""One of two JAX processes that snapshot into their own sidecars, then (run again after both
were killed) restore from those sidecars' RAM.

Run by test_elastic_multi.py; argv as in ckpt_processes.py (the directory unused), then the
mode: "train" (snapshots of steps 1-5, step 4 waited for, prints "ready", then waits on stdin
to be killed), "resume" (restores the newest snapshot complete everywhere, checks it bit for
bit, takes and waits for the next step, prints "OK <json>") or "hold" (restores and checks, prints
"OK <json>", then waits on stdin to be killed: its keepers keep what the restore refilled).
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from ckpt_processes import start  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

process, cluster, _ = start(heartbeat_seconds=3.0)  # a busy test machine misses 1 s beats
mode = sys.argv[6]

from colocar.elastic.snapshots import Snapshots  # noqa: E402

mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("d", "m"))
SHARDINGS = {
    "w": NamedSharding(mesh, P("d", "m")),
    "b": NamedSharding(mesh, P()),
    "v": NamedSharding(mesh, P("m")),
}
W0 = np.random.default_rng(7).integers(-1000, 1000, (64, 16)).astype(np.float32)
B0 = np.arange(8, dtype=np.float32)
V0 = np.random.default_rng(8).integers(0, 1000, (6,)).astype(np.int32)


def expected(step: int) -> dict:
    """The state after `step` steps, exactly (integer-valued updates in float32 are exact)."""
    return {"w": W0 + step * (step + 1) / 2, "b": B0 * 2.0**step, "v": V0 + step, "step": step}


def make(step: int) -> dict:
    want = expected(step)
    out = {
        k: jax.make_array_from_callback(want[k].shape, s, want[k].__getitem__) for k, s in SHARDINGS.items()
    }
    return {**out, "step": step, "host": np.full(3, step)}


@jax.jit
def train_step(state: dict, step: int) -> dict:
    return {"w": state["w"] + step, "b": state["b"] * 2.0, "v": state["v"] + 1}


def check(state: dict, step: int) -> None:
    want = expected(step)
    for key in SHARDINGS:
        assert state[key].sharding == SHARDINGS[key], (key, state[key].sharding)
        for shard in state[key].addressable_shards:
            got, ref = np.asarray(shard.data), want[key][shard.index]
            assert got.dtype == ref.dtype and got.tobytes() == ref.tobytes(), (key, step, shard.index)
    assert state["step"] == step and np.array_equal(state["host"], np.full(3, step))


snaps = Snapshots(cluster, replicas=1, name="mc-test", replication_timeout=60)
if mode == "train":
    state = make(0)
    for step in range(5):
        state = {**train_step({k: state[k] for k in SHARDINGS}, step + 1), "step": step + 1}
        state["host"] = np.full(3, step + 1)
        assert snaps.take(step + 1, state)
        if step + 1 == 4:
            snaps.wait()
    check(state, 5)
    print("ready", json.dumps(snaps.stats()["committed"]), flush=True)
    sys.stdin.readline()  # killed here
    sys.exit(3)
target: dict = {
    k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=SHARDINGS[k])
    for k, v in make(0).items()
    if k in SHARDINGS
}
target.update(step=None, host=None)
found = snaps.latest()
assert found is not None, "no snapshot complete everywhere"
step = found
state = snaps.restore(step, target)
check(state, step)
refilled = snaps.stats()["refilled_bytes"]
if mode == "hold":
    print("OK", json.dumps({"step": step, "refilled_bytes": refilled}), flush=True)
    sys.stdin.readline()  # killed here
    sys.exit(3)
state = {
    **train_step({k: state[k] for k in SHARDINGS}, step + 1),
    "step": step + 1,
    "host": np.full(3, step + 1),
}
assert snaps.take(step + 1, state)
snaps.wait()
assert snaps.latest() == step + 1
check(snaps.restore(step + 1, target), step + 1)
print(
    "OK",
    json.dumps({"step": step, "refilled_bytes": refilled, "committed": snaps.stats()["committed"]}),
    flush=True,
)
snaps.close()
jnp.zeros(1).block_until_ready()
