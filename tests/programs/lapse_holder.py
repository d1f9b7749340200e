"""A controller holding an array over its session's blocks, for a test to pause past its lease.

Run by test_session_lapse.py; argv: sidecar address, token file. Connects (an unnamed session,
a 1 s lease), keeps a 64 Ki float32 result of ones (an arena view), prints "READY", then on a
line "check" on stdin: makes three more results of twos (after its session lapsed they reuse
the freed blocks unless the kept one still holds its own), waiting out the reconnect, and prints
"CHECK <the three were twos> <the kept result is still all ones>".
"""

import os
import sys
import time

os.environ["JAX_PLATFORMS"] = "cpu"

import numpy as np  # noqa: E402

import colocar  # noqa: E402

cluster = colocar.connect([sys.argv[1]], token_file=sys.argv[2], lease_seconds=1, heartbeat_seconds=0.25)
host = cluster.hosts[0]


@colocar.colocated
def filled(value):
    out = colocar.shm.empty((1 << 16,), np.float32)
    out[:] = value
    return out


def made_after_reconnect(value: float) -> np.ndarray:
    """A result of `value`, retried while the controller learns of the lapse and reconnects."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return np.asarray(filled.on(host)(value))
        except colocar.HostLostError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


kept = filled.on(host)(1.0)
print("READY", flush=True)
for line in sys.stdin:
    if line.strip() == "check":
        twos = all(bool((made_after_reconnect(2.0) == 2.0).all()) for _ in range(3))
        print("CHECK", twos, float(kept.min()) == float(kept.max()) == 1.0, flush=True)
