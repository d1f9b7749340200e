"""One of two JAX processes that snapshot into their own sidecars, then (run again after both
were killed) restore from those sidecars' RAM.

Run by test_elastic_multi.py; argv as in ckpt_processes.py (the directory unused), then the
mode: "train" (snapshots of steps 1-5, step 4 waited for, prints "ready", then waits on stdin
to be killed), "held" (as "train", but prints "ready" before step 5 and waits for a line on
stdin, then takes step 5, prints "taken" and waits to be killed), "resume" (restores the
newest snapshot complete everywhere, checks it bit for bit, takes and waits for the next step,
prints "OK <json>"), "hold" (restores and checks, prints
"OK <json>", then waits on stdin to be killed: its keepers keep what the restore refilled) or
"reshard" (restores the newest snapshot onto other shardings and meshes, each checked bit for bit,
then in the saved layout, prints "OK <json>") or "save" (saves the newest snapshot to storage in
the directory with `save_to`, restores it from there in the saved layout and another one, each
checked bit for bit, prints "OK <json>").
"""

import json
import os
import sys
import time

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
flat = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))  # another mesh of the same devices
SHARDINGS = {
    "w": NamedSharding(mesh, P("d", "m")),
    "b": NamedSharding(mesh, P()),
    "v": NamedSharding(mesh, P("m")),
    "h": NamedSharding(mesh, P("d")),
    "s": NamedSharding(mesh, P()),
}
RESHARDED = [  # each process needs parts of the other's shards for w and h
    {
        "w": NamedSharding(mesh, P("m", None)),
        "b": NamedSharding(mesh, P("d")),
        "v": NamedSharding(flat, P()),
        "h": NamedSharding(flat, P(None, "a")),
        "s": NamedSharding(flat, P()),
    },
    {
        "w": NamedSharding(flat, P("b", "a")),
        "b": NamedSharding(flat, P("b")),
        "v": NamedSharding(flat, P("a")),
        "h": NamedSharding(mesh, P()),
        "s": NamedSharding(mesh, P()),
    },
]
W0 = np.random.default_rng(7).integers(-1000, 1000, (64, 16)).astype(np.float32)
B0 = np.arange(8, dtype=np.float32)
V0 = np.random.default_rng(8).integers(0, 1000, (6,)).astype(np.int32)
H0 = np.random.default_rng(9).integers(0, 100, (8, 6)).astype(jnp.bfloat16)


def expected(step: int) -> dict:
    """The state after `step` steps, exactly (integer-valued updates in float32 and small
    integers in bfloat16 are exact)."""
    return {
        "w": W0 + step * (step + 1) / 2,
        "b": B0 * 2.0**step,
        "v": V0 + step,
        "h": (H0.astype(np.float32) + step).astype(jnp.bfloat16),
        "s": np.array(3 * step, np.int32),
        "step": step,
    }


def make(step: int) -> dict:
    want = expected(step)
    out = {
        k: jax.make_array_from_callback(want[k].shape, s, want[k].__getitem__) for k, s in SHARDINGS.items()
    }
    return {**out, "step": step, "host": np.full(3, step)}


@jax.jit
def train_step(state: dict, step: int) -> dict:
    h = (state["h"].astype(jnp.float32) + 1).astype(jnp.bfloat16)
    return {"w": state["w"] + step, "b": state["b"] * 2.0, "v": state["v"] + 1, "h": h, "s": state["s"] + 3}


def check(state: dict, step: int, shardings: dict = SHARDINGS) -> None:
    """Every addressable shard of every array, bit for bit, on `shardings`."""
    want = expected(step)
    for key in SHARDINGS:
        assert state[key].sharding == shardings[key], (key, state[key].sharding)
        for shard in state[key].addressable_shards:
            got, ref = np.asarray(shard.data), want[key][shard.index]
            assert got.dtype == ref.dtype and got.tobytes() == ref.tobytes(), (key, step, shard.index)
    assert state["step"] == step and np.array_equal(state["host"], np.full(3, step))


def previous_hosts(hosts: list, replicas: int) -> dict:
    """A placement of its own (on two processes the same peers as the default ring)."""
    return {h: [hosts[(i - k) % len(hosts)] for k in range(1, replicas + 1)] for i, h in enumerate(hosts)}


snaps = Snapshots(cluster, replicas=1, name="mc-test", replication_timeout=60, placement=previous_hosts)
if mode in ("train", "held"):
    state = make(0)
    for step in range(5):
        if mode == "held" and step + 1 == 5:  # the test holds replication now
            print("ready", json.dumps(snaps.stats()["committed"]), flush=True)
            sys.stdin.readline()
        state = {**train_step({k: state[k] for k in SHARDINGS}, step + 1), "step": step + 1}
        state["host"] = np.full(3, step + 1)
        assert snaps.take(step + 1, state)
        if step + 1 == 4:
            snaps.wait()
    check(state, 5)
    if mode == "held":
        time.sleep(1.0)  # the commit thread hands step 5's record to the keeper, which holds it
    print("ready" if mode == "train" else "taken", json.dumps(snaps.stats()["committed"]), flush=True)
    sys.stdin.readline()  # killed here
    sys.exit(3)


def target_on(shardings: dict) -> dict:
    out: dict = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k])
        for k, v in make(0).items()
        if k in SHARDINGS
    }
    return {**out, "step": None, "host": None}


target = target_on(SHARDINGS)
found = snaps.latest()
assert found is not None, "no snapshot complete everywhere"
step = found
if mode == "save":  # to storage from the sidecars' blocks, then restored from there
    from colocar.checkpoint import CheckpointManager

    manager = CheckpointManager(sys.argv[5], cluster, max_chunk_bytes=256, commit_timeout=60)
    assert snaps.save_to(manager, step, metadata={"from": "snapshot"})
    manager.wait()
    assert manager.latest_step() == step, manager.all_steps()
    check(manager.restore(step, target), step)
    check(manager.restore(step, target_on(RESHARDED[1])), step, RESHARDED[1])
    saved = manager.stats()["save"]  # this process's part: pieces written, none copied from devices
    out = {"step": step, "refilled_bytes": snaps.stats()["refilled_bytes"], "pieces": saved["pieces"]}
    print("OK", json.dumps({**out, "device_bytes": saved["bytes"]}), flush=True)
    manager.close()
    sys.exit(0)
state = snaps.restore(step, target)
check(state, step)
refilled, fetched = snaps.stats()["refilled_bytes"], snaps.stats()["fetched_bytes"]
if mode == "reshard":
    for shardings in RESHARDED:
        check(snaps.restore(step, target_on(shardings)), step, shardings)
    check(snaps.restore(step, target), step)
    out = {"step": step, "refilled_bytes": refilled, "fetched": [fetched, snaps.stats()["fetched_bytes"]]}
    print("OK", json.dumps(out), flush=True)
    sys.exit(0)
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
    json.dumps(
        {
            "step": step,
            "refilled_bytes": refilled,
            "committed": snaps.stats()["committed"],
            "fetched": fetched,
        }
    ),
    flush=True,
)
snaps.close()
jnp.zeros(1).block_until_ready()
