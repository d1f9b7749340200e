"""One of two JAX processes (jax.distributed on localhost) of a job that joins a shared pool.

argv: process index, coordinator port, the pool file, the tenant's token file, the name of
the machine this process stands for (COLOCAR_NODE_NAME, as the pool's nodes have theirs).
Each process connects with `colocar.connect(pool=...)` and must get the one sidecar on its
machine; a colocated call on an array sharded over both processes' 8 devices is checked
against numpy. Prints `RESULT {json}` (the pids above the sidecar that served it: its node)
and "OK".
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
process, port, pool_file, token_file, machine = int(sys.argv[1]), sys.argv[2], *sys.argv[3:6]
os.environ["COLOCAR_NODE_NAME"] = machine

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process)
import colocar  # noqa: E402


@colocar.colocated
def affine(x):
    return x * 2 + 1


@colocar.colocated
def ancestors():
    import psutil

    return [p.pid for p in psutil.Process().parents()]


with colocar.connect(pool=pool_file, token_file=token_file) as cluster:
    assert len(cluster.hosts) == 1, cluster.hosts
    full = np.arange(32 * 4, dtype=np.float32).reshape(32, 4)
    mesh = Mesh(np.array(jax.devices()).reshape(8), ("d",))
    x = jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("d")), lambda index: full[index])
    y = affine(x)
    for shard in y.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index] * 2 + 1)
    print("RESULT " + json.dumps({"ancestors": ancestors.on(cluster.hosts[0])()}), flush=True)
jax.distributed.shutdown()
print("OK", flush=True)
