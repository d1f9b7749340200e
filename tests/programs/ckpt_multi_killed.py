"""One of two JAX processes saving step 3 together; one stops mid-save for the test to kill.

Run by test_checkpoint_recovery.py; argv as in ckpt_processes.py, then the index of the process
to stop. Both print "ready" and wait for a line on stdin. The one to stop then begins its save
(its writer learns the step's plan) but, instead of handing over its shards, prints "mid-save"
and waits to be killed. The other saves and waits with a commit_timeout of 600 s, then prints
"committed" or "failed: <error>".
"""

import os
import sys
import threading

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

from ckpt_processes import saver, start  # noqa: E402

process, cluster, directory = start()
w, m = saver(cluster, directory, commit_timeout=600)  # the default: what the others used to wait
if process == int(sys.argv[6]):
    from colocar.checkpoint.saves import plan as save

    def stuck(*args, **kwargs):  # the save has begun on this host's writer; nothing is handed over
        print("mid-save", flush=True)
        threading.Event().wait()

    save.send = stuck
print("ready", flush=True)
sys.stdin.readline()
try:
    m.save(3, {"w": w})
    m.wait()
    print("committed", flush=True)
except Exception as e:
    print("failed:", type(e).__name__, e, flush=True)
