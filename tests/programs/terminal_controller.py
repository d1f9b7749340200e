"""A controller in a terminal whose Ctrl-C the test types (a ^C on a pty: SIGINT to the whole
foreground process group), during a call, a generator, a loader's next() and a checkpoint wait().

Run by test_interactive_terminal.py; argv: a folder for the markers, a checkpoint URL, the URL
the sidecars reach GCS at (through a proxy the test can pause). Before
each wait it prints "STAGE <name>"; a remote part that has started writes `<folder>/<name>-*`
files, and the test sends ^C once they are there; the program prints "INTERRUPTED <name>
<seconds>" (how long the KeyboardInterrupt took to come) and then "RESULT <name> <what the next
call returned>" (its remote part passes once the test lifted the block: `<folder>/<name>.go`). At the end it
closes the cluster and prints "DONE".
"""

import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import colocar  # noqa: E402
from colocar import loaders  # noqa: E402
from colocar.checkpoint import CheckpointManager  # noqa: E402

folder, checkpoints, sidecars_gcs = sys.argv[1:4]
sent_at = os.path.join(folder, "sent")  # the test writes the time it typed ^C into this file


def block(stage, tag, limit=600.0):
    """In a sidecar (or a pipeline worker): says it started, then waits for `<stage>.go`."""
    import os
    import time

    open(os.path.join(folder, f"{stage}-{tag}-{os.getpid()}"), "w").close()
    deadline = time.monotonic() + limit
    while not os.path.exists(os.path.join(folder, f"{stage}.go")) and time.monotonic() < deadline:
        time.sleep(0.01)


@colocar.colocated
def wait_then(stage, value):
    block(stage, "call")
    return value


@colocar.colocated
def items(stage, n):
    for i in range(n):
        if i == 1:
            block(stage, "item")
        yield i


def features(record):
    i = int(record["index"])
    if 12 <= i < 16:  # batch 1 on the second host only: the first hands its part over first
        block("loader", "record")
    return {"label": np.int32(i)}


def interrupted(stage, wait):
    started = time.monotonic()
    try:
        print(f"STAGE {stage}", flush=True)
        wait()
    except KeyboardInterrupt:
        with open(sent_at) as f:
            print(f"INTERRUPTED {stage} {time.time() - float(f.read()):.3f}", flush=True)
        return
    print(f"NOT INTERRUPTED {stage} after {time.monotonic() - started:.1f} s", flush=True)


cluster = colocar.local_cluster(
    hosts=2, arena_size=32 << 20, processes=1, env={"TENSORSTORE_GCS_HTTP_URL": sidecars_gcs}
)
print("SIDECARS", *[p.pid for p in cluster.processes], flush=True)
hosts = cluster.hosts

interrupted("call", lambda: wait_then.on(hosts)("call", "late"))
print("RESULT call", wait_then.on(hosts)("call", "own"), flush=True)

stream = items.on(hosts[0])("generator", 3)
print("FIRST generator", next(stream), flush=True)
interrupted("generator", lambda: next(stream))
print("RESULT generator", list(items.on(hosts[0])("generator", 3)), flush=True)

pipeline = {
    "source": {"kind": "range", "n": 64},
    "global_batch_size": 8,
    "shuffle": False,
    "transforms": [{"kind": "map", "fn": features}],
    "num_epochs": 1,
    "workers_per_host": 1,
}
with loaders.load(pipeline, cluster) as it:
    print("FIRST loader", np.asarray(next(it)["label"]).tolist(), flush=True)
    interrupted("loader", lambda: next(it))
    print("RESULT loader", np.asarray(next(it)["label"]).tolist(), flush=True)

mesh = cluster.mesh(("data",))
state = {"w": jax.device_put(np.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("data")))}
manager = CheckpointManager(checkpoints, cluster)
print("READY checkpoint", flush=True)  # the test pauses the sidecars' storage, then says so
while not os.path.exists(os.path.join(folder, "paused")):
    time.sleep(0.01)
manager.save(1, state)  # returns once the state is in the arenas: the writes are the sidecars'

interrupted("checkpoint", manager.wait)
manager.wait()
restored = manager.restore(1, target=state)
print("RESULT checkpoint", bool((np.asarray(restored["w"]) == np.asarray(state["w"])).all()), flush=True)
manager.close()
cluster.close()
print("DONE", flush=True)
