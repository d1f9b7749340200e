"""The demo job: two sidecars on loopback, arrays in and out, a remote object, a checkpoint, stats.

Run with `make demo`. The same code runs against real hosts with `colocar.connect(...)`.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import colocar  # noqa: E402
from colocar.checkpoint import CheckpointManager  # noqa: E402


@colocar.colocated
def scale(x):
    """Runs in the sidecar of each host holding part of x; x is that host's block, as numpy."""
    return x * 2


@colocar.colocated
def whoami():
    import os
    import socket

    return f"{socket.gethostname()} pid {os.getpid()}"


@colocar.colocated_class
class Counter:
    def __init__(self, start):
        self.n = start

    def add(self, k):
        self.n += k
        return self.n


def main() -> None:
    with colocar.local_cluster(hosts=2) as cluster:
        print(cluster)
        mesh = cluster.mesh(("data",))
        x = jax.device_put(np.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("data")))
        y = scale(x)
        assert np.array_equal(np.asarray(y), np.asarray(x) * 2)
        print("scale(x): sharding", y.sharding.spec, "first column", np.asarray(y)[:, 0])
        print("whoami on each host:", whoami.on(cluster.hosts)())
        counter = Counter.on(cluster.hosts[0])(10)
        print("remote counter:", counter.add(5), counter.add(5))
        with tempfile.TemporaryDirectory() as directory, CheckpointManager(directory, cluster) as mngr:
            mngr.save(1, {"x": x, "note": "demo"})  # returns once the shards are in the arenas
            mngr.wait()  # the sidecars wrote them with tensorstore and committed the step
            other = NamedSharding(cluster.mesh(("a", "b"), (2, 4)), P(None, ("a", "b")))
            target = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=other), "note": None}
            restored = mngr.restore(target=target)
            assert np.array_equal(np.asarray(restored["x"]), np.asarray(x))
            print(f"checkpoint: steps {mngr.all_steps()}, restored as {restored['x'].sharding.spec}")
        for host in cluster.hosts:
            s = host.stats()
            print(f"{host.name}: {s['calls']} calls, p50 {s['latency_p50_us']:.0f} us, shm={host.shm}")
    print("demo done")


if __name__ == "__main__":
    main()
