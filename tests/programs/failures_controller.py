"""A controller that holds remote objects and a staged block, then sleeps until killed.

Run by test_failures_sessions.py; argv: sidecar address, token file, the file it creates
once everything is held.
"""

import sys
import time
from typing import Any

import numpy as np

import colocar

address, token_file, ready = sys.argv[1:4]
with open(token_file) as f:
    token = f.read().strip()
cluster = colocar.connect([address], token=token, lease_seconds=2, heartbeat_seconds=0.5)
host = cluster.hosts[0]


@colocar.colocated_class
class Holder:
    def __init__(self, nbytes):
        self.array = colocar.shm.empty((nbytes,), np.uint8)
        self.array[:] = 1

    def size(self):
        return self.array.nbytes


remote: Any = Holder  # colocated_class adds `.on`, which the type of a class does not show
holders = [remote.on(host)(1 << 20)] + [remote.on(host)(64) for _ in range(3)]
staged = host.connection.blocks.empty([((1 << 20,), np.dtype(np.uint8))])
assert holders[0].size() == 1 << 20
with open(ready, "w") as f:
    f.write("READY")
print("READY", flush=True)
time.sleep(600)
