"""One of two JAX processes that save steps after the test broke something.

Run by test_checkpoint_multi.py; argv as in ckpt_processes.py, then the steps to save
(comma-separated) and which process saves them ("all", or one process index). Prints
"ready", waits for a line on stdin, then "committed <step>" or "failed: <step> <error>".
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

from ckpt_processes import saver, start  # noqa: E402

process, cluster, directory = start()
w, m = saver(cluster, directory)
steps = [int(step) for step in sys.argv[6].split(",")]
if sys.argv[7] != "all" and process != int(sys.argv[7]):
    steps = []
print("ready", flush=True)
sys.stdin.readline()  # meanwhile the test breaks something (kills a sidecar, takes the lease)
for step in steps:  # the second save, after a failed one, must agree on what it is too
    try:
        m.save(step, {"w": w})
        m.wait()
        print("committed", step, flush=True)
    except Exception as e:
        print("failed:", step, type(e).__name__, e, flush=True)
