"""A trainer of the checkpoint crash drills: saves steps until the test SIGKILLs it.

Run by test_checkpoint_drills.py; argv: sidecar addresses (comma-separated), token file,
checkpoint directory, generation, first step, number of steps, rows. Every step's state is
`drill_state(step, generation, rows)` (so a restore shows which trainer wrote each chunk);
it prints "saving <step>" before a save and "saved <step>" once `save` returned, then "done"
after the last one is committed.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

from checkpoint_helpers import drill_state  # noqa: E402

import colocar  # noqa: E402
from colocar.checkpoint import CheckpointManager  # noqa: E402

addresses, token_file, directory = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
generation, first, count, rows = (int(a) for a in sys.argv[4:8])
cluster = colocar.connect(addresses, token_file=token_file)
m = CheckpointManager(directory, cluster, max_chunk_bytes=16 * 1024, queue=True, concurrent_writes=1)
for step in range(first, first + count):
    print("saving", step, flush=True)
    m.save(step, drill_state(step, generation, rows))
    print("saved", step, flush=True)
m.wait()
print("done", flush=True)
