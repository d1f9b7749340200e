"""A checkpoint writer that the test pauses past its lease, then lets save again.

Run by test_checkpoint_failures.py; argv: sidecar address, token file, checkpoint directory.
It prints "ready" after its first save, waits for a line on stdin, then prints "saved" or
"refused: <error>".
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import numpy as np  # noqa: E402

import colocar  # noqa: E402
from colocar.checkpoint import CheckpointError, CheckpointManager  # noqa: E402

address, token_file, directory = sys.argv[1:4]
cluster = colocar.connect([address], token_file=token_file)
m = CheckpointManager(directory, cluster, lease_seconds=2)
m.save(1, {"x": np.arange(4)})
m.wait()
print("ready", flush=True)
sys.stdin.readline()  # the test paused this process, let another writer take over, resumed it
try:
    m.save(2, {"x": np.arange(4)})
    m.wait()
    print("saved", flush=True)
except CheckpointError as e:
    print("refused:", e, flush=True)
