"""A tenant's job on a shared pool that holds arena blocks and an object, for a test to kill.

Run by test_pool_queue.py; argv: the pool file, the tenant's token file and, optionally, a
session name (the object is then named "box"). It joins the pool, leases 4 MiB of arena on
each host and makes an object, prints "READY <arena bytes its session holds on host 0>", then
waits on stdin (it is killed there).
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import colocar  # noqa: E402

pool_file, token_file = sys.argv[1:3]
session = sys.argv[3] if len(sys.argv) > 3 else None
cluster = colocar.connect(pool=pool_file, token_file=token_file, heartbeat_seconds=0.5, session=session)
held = [h.connection.blocks.allocate([4 << 20]) for h in cluster.hosts]


class Box:
    def __init__(self, n: int):
        self.n = n

    def value(self) -> int:
        return self.n


box = colocar.colocated_class(Box).on(cluster.hosts[0], name="box" if session else None)(3)
print("READY", cluster.hosts[0].stats()["pools"]["default"]["used"], flush=True)
sys.stdin.readline()
