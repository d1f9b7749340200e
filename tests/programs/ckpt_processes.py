"""What the two-process checkpoint programs share (imported by ckpt_multi_*.py).

One of two jax.distributed CPU processes (argv: process index, coordinator port, its own
sidecar's address, the token file, the checkpoint directory), connected to its own sidecar.
The importing program sets XLA_FLAGS (4 devices) and JAX_PLATFORMS before JAX loads.
"""

import sys
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def start(**options: Any) -> tuple[int, Any, str]:
    """Joins jax.distributed and connects to this process's sidecar (`options` go to
    `colocar.connect`): (process, cluster, directory)."""
    process, port = int(sys.argv[1]), sys.argv[2]
    address, token_file, directory = sys.argv[3:6]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process)
    import colocar  # after jax.distributed.initialize, as in a training program

    cluster = colocar.connect([address], token_file=token_file, **options)
    return process, cluster, directory


def saver(cluster: Any, directory: str, commit_timeout: float = 5) -> tuple[jax.Array, Any]:
    """`w` sharded over both processes' 8 devices and a manager (commit_timeout 5 s unless given)."""
    from colocar.checkpoint import CheckpointManager

    full = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    mesh = Mesh(np.array(jax.devices()).reshape(8), ("d",))
    w = jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("d")), lambda index: full[index])
    m = CheckpointManager(directory, cluster, max_chunk_bytes=1 << 20, commit_timeout=commit_timeout)
    return w, m
