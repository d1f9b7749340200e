"""One of two JAX processes that save a step together and restore it resharded.

Run by test_checkpoint_multi.py; argv as in ckpt_processes.py. Prints "OK <bytes read>".
"""

import json
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from ckpt_processes import start  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

process, cluster, directory = start()

from colocar.checkpoint import CheckpointManager  # noqa: E402

full = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)


def make(sharding: NamedSharding) -> jax.Array:
    return jax.make_array_from_callback(full.shape, sharding, lambda index: full[index])


mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("d", "m"))
state: dict = {
    "w": make(NamedSharding(mesh, P("d", "m"))),
    "b": make(NamedSharding(mesh, P())),
    "step": 3,
    "host": np.arange(4),
}
m = CheckpointManager(directory, cluster, max_chunk_bytes=1 << 20)
m.save(3, state)
m.wait()
other = NamedSharding(Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b")), P("b", "a"))
restored = m.restore(
    target={"w": jax.ShapeDtypeStruct(full.shape, np.float32, sharding=other), "step": None, "host": None}
)
for shard in restored["w"].addressable_shards:
    assert np.array_equal(np.asarray(shard.data), full[shard.index])
assert restored["step"] == 3 and np.array_equal(restored["host"], np.arange(4))
read = m.stats()["restore"]["bytes_read"]
saved = m.restore()  # no target: the saved shardings, over both processes' devices
assert saved["w"].sharding == state["w"].sharding and saved["b"].sharding == state["b"].sharding
for key in ("w", "b"):
    for shard in saved[key].addressable_shards:
        assert np.array_equal(np.asarray(shard.data), full[shard.index])
m.close()
print("OK", json.dumps(read), flush=True)
