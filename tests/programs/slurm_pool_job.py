"""A tenant's job step on a shared pool under Slurm: one of its jax.distributed processes.

Run by tests/test_slurm_pool.py as `srun --jobid=<pool job> --overlap -N2 --ntasks-per-node=1
python THIS ...`; argv: the pool
file, the tenant's token file, the JAX coordinator's host:port (the fake cluster's node names
do not resolve). Each process joins through the pool and must get the one sidecar on its own
node (the sidecar's SLURMD_NODENAME is its node's); a colocated call on an array sharded over
both processes' 8 devices is checked against numpy. Prints `RESULT {json}` and "OK".
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
pool_file, token_file, coordinator = sys.argv[1:4]
process, processes = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
node = os.environ["SLURMD_NODENAME"]

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

jax.distributed.initialize(coordinator, num_processes=processes, process_id=process)
import colocar  # noqa: E402


@colocar.colocated
def affine(x):
    return x * 2 + 1


@colocar.colocated
def where() -> dict:
    return {k: os.environ.get(k, "") for k in ("SLURMD_NODENAME", "COLOCAR_NODE_NAME")}


with colocar.connect(pool=pool_file, token_file=token_file) as cluster:
    assert len(cluster.hosts) == 1, cluster.hosts
    full = np.arange(32 * 4, dtype=np.float32).reshape(32, 4)
    mesh = Mesh(np.array(jax.devices()).reshape(4 * processes), ("d",))
    x = jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("d")), lambda index: full[index])
    y = affine(x)
    for shard in y.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index] * 2 + 1)
    result = {"process": process, "node": node, "sidecar": where.on(cluster.hosts[0])()}
    print("RESULT " + json.dumps(result), flush=True)
jax.distributed.shutdown()
print("OK", flush=True)
