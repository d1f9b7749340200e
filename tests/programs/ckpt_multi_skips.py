"""One of two JAX processes whose training loops save different steps (one skips a save).

Run by test_collectives_skipped.py; argv as in ckpt_processes.py, then the steps process 0
saves and the steps process 1 saves (comma-separated, may be empty). Each save is followed by
`wait()`; prints "committed <step>" or "failed: <step> <error>" for each, then "OK".
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

from ckpt_processes import saver, start  # noqa: E402

process, cluster, directory = start()
w, m = saver(cluster, directory, commit_timeout=2)  # every save here fails: waits kept short
for step in [int(s) for s in sys.argv[6 + process].split(",") if s]:
    try:
        m.save(step, {"w": w})
        m.wait()
        print("committed", step, flush=True)
    except Exception as e:
        print("failed:", step, type(e).__name__, e, flush=True)
print("OK", flush=True)
