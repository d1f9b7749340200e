"""One of two JAX processes, each with its own sidecar, in Orbax's layout.

Run by test_checkpoint_orbax.py; argv as in ckpt_processes.py, then `save` (save
`orbax_states.state(11)` as step 2 in Orbax's layout together, restore it onto another mesh) or
`restore` (restore step 1, which two Orbax processes wrote from `state(12)`). Prints "OK".
"""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

import orbax_states  # noqa: E402
from ckpt_processes import start  # noqa: E402

process, cluster, directory = start()

from colocar.checkpoint import CheckpointManager  # noqa: E402

mode = sys.argv[6]
m = CheckpointManager(directory, cluster, layout="orbax", max_chunk_bytes=8 * 1024)
if mode == "save":
    m.save(2, orbax_states.state(11))
    m.wait()
    seed, step = 11, 2
else:
    seed, step = 12, 1
bad = orbax_states.mismatches(m.restore(step, orbax_states.target(seed)), seed)
m.close()
print("\n".join(bad) if bad else "OK", flush=True)
