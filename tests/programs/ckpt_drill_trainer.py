"""A trainer of the checkpoint crash drills: restores the latest step, then saves the next ones
until the test SIGKILLs it.

Run by test_checkpoint_drills.py; argv: sidecar addresses (comma-separated), token file,
checkpoint directory, generation, number of steps, rows. Every step's state is
`drill_state(step, generation, rows)` (so a restore shows which trainer wrote each chunk). It
prints "saving <step>" before a save, "saved <step>" once `save` returned, "exists <step>" when
a dead trainer's writers committed that step meanwhile (it goes on with the next), and "done"
after the last one is committed. $COLOCAR_DRILL_LAYOUT: the layout it saves in (colocar's).
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

from checkpoint_helpers import abstract, drill_state  # noqa: E402

import colocar  # noqa: E402
from colocar.checkpoint import CheckpointError, CheckpointManager  # noqa: E402

addresses, token_file, directory = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
generation, count, rows = (int(a) for a in sys.argv[4:7])
cluster = colocar.connect(addresses, token_file=token_file)
layout = os.environ.get("COLOCAR_DRILL_LAYOUT", "colocar")
m = CheckpointManager(
    directory, cluster, max_chunk_bytes=16 * 1024, queue=True, concurrent_writes=1, layout=layout
)
latest = m.latest_step()
if latest is not None:
    m.restore(latest, target=abstract(drill_state(latest, 0, rows)))  # the test checks every step
step = (latest or 0) + 1
for _ in range(count):
    print("saving", step, flush=True)
    try:
        m.save(step, drill_state(step, generation, rows))
        print("saved", step, flush=True)
    except CheckpointError as e:
        if f"step {step} already exists" not in str(e):
            raise
        print("exists", step, flush=True)
    step += 1
m.wait()
print("done", flush=True)
