"""A trainer that saves one step and SIGKILLs itself right after `save` returned.

Run by test_checkpoint_failures.py; argv: sidecar addresses (comma-separated), token file,
checkpoint directory and optionally the layout (colocar's by default).
"""

import os
import signal
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import colocar  # noqa: E402
from colocar.checkpoint import CheckpointManager  # noqa: E402

addresses, token_file, directory = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
cluster = colocar.connect(addresses, token_file=token_file)
mesh = Mesh(np.array(jax.devices()).reshape(8), ("d",))
values = np.arange(8 * 1024 * 64, dtype=np.float32).reshape(8 * 1024, 64)
w = jax.device_put(values, NamedSharding(mesh, P("d")))
layout = sys.argv[4] if len(sys.argv) > 4 else "colocar"
m = CheckpointManager(directory, cluster, max_chunk_bytes=64 * 1024, layout=layout)
m.save(1, {"w": w, "note": "from a dead trainer"})
os.kill(os.getpid(), signal.SIGKILL)  # right after save returned: nothing else runs here
