"""A tenant's job on a shared pool that holds arena blocks and an object, for a test to kill.

Run by test_pool_queue.py; argv: the pool file, the tenant's token file. It joins the pool,
leases 4 MiB of arena on each host and makes an object, prints "READY <arena bytes its
session holds on host 0>", then waits on stdin (it is killed there).
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import colocar  # noqa: E402

pool_file, token_file = sys.argv[1:3]
cluster = colocar.connect(pool=pool_file, token_file=token_file, heartbeat_seconds=0.5)
held = [h.connection.blocks.allocate([4 << 20]) for h in cluster.hosts]


class Box:
    def __init__(self, n: int):
        self.n = n


box = colocar.colocated_class(Box).on(cluster.hosts[0])(3)
print("READY", cluster.hosts[0].stats()["pools"]["default"]["used"], flush=True)
sys.stdin.readline()
