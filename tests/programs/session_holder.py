"""A controller with a named session that holds things on its sidecar, for the tests to kill,
pause and take over.

Run by test_sessions_named.py; argv: sidecar address, token file, session name, grace seconds
(0: the sidecar's), lease seconds. It makes a named object "counter" (at 10), an unnamed
object, a 1 MiB result it keeps (an arena view) and a loader, prints "READY <arena bytes its
session holds>", then answers lines on stdin: "check" prints "CHECK <counter + 1> <the kept
array unchanged> <the unnamed object's answer> <the loader's next batch>", EOF ends it.
"""

import os
import sys
from typing import Any

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import numpy as np  # noqa: E402

import colocar  # noqa: E402
from colocar import loaders  # noqa: E402

address, token_file, name, grace, lease = sys.argv[1:6]
cluster = colocar.connect(
    [address],
    token_file=token_file,
    session=name,
    grace_seconds=float(grace) or None,
    lease_seconds=float(lease),
    heartbeat_seconds=0.5,
)
host = cluster.hosts[0]


@colocar.colocated_class
class Counter:
    def __init__(self, n):
        self.n = n

    def add(self, k):
        self.n += k
        return self.n


@colocar.colocated
def filled(nbytes, value):
    import numpy as np

    out = colocar.shm.empty((nbytes,), np.uint8)
    out[:] = value
    return out


remote: Any = Counter  # colocated_class adds `.on`, which the type of a class does not show
counter = remote.on(host, name="counter")(10)
unnamed = remote.on(host)(100)
kept = filled.on(host)(1 << 20, 7)
it = loaders.load({"source": {"kind": "range", "n": 4096}, "global_batch_size": 8, "shuffle": False}, cluster)
next(it)  # batch 0: the loader is running
print("READY", host.stats()["pools"]["default"]["used"], flush=True)
for line in sys.stdin:
    if line.strip() == "check":
        batch = np.asarray(next(it)["index"]).tolist()
        print("CHECK", counter.add(1), bool((kept == 7).all()), unnamed.add(1), batch, flush=True)
