"""One of two JAX processes: process 0 saves step 3 at once, process 1 once the test stopped
process 0's sidecar (the one that commits).

Run by test_checkpoint_multi.py; argv as in ckpt_processes.py. Process 0 prints "saved";
after a line on stdin process 1 prints "committed" or "failed: <error>".
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

from ckpt_processes import saver, start  # noqa: E402

process, cluster, directory = start()
w, m = saver(cluster, directory)
if process == 0:
    m.save(3, {"w": w})
    print("saved", flush=True)
sys.stdin.readline()  # process 1 saves once the test has stopped process 0's sidecar
if process == 1:
    try:
        m.save(3, {"w": w})
        m.wait()
        print("committed", flush=True)
    except Exception as e:
        print("failed:", type(e).__name__, e, flush=True)
