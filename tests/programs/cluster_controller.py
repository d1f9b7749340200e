"""A controller that starts a one-host local cluster, prints its sidecar's pid, arena path and
work folder, and waits for the end of stdin (the test kills it, or closes stdin: it then ends
without closing the cluster, a call's future still unread in a global).

Run by test_cluster.py; no arguments.
"""

import os
import sys
from typing import Any

import colocar

c: Any = colocar.local_cluster(hosts=1, arena_size=16 << 20, processes=0)
print(
    c.processes[0].pid,
    c.hosts[0].connection.session.info.arena_path,
    os.path.dirname(c.token_file),
    flush=True,
)
unread = colocar.colocated(os.getpid).on(c.hosts[0]).submit()  # dropped as the interpreter exits
sys.stdin.read()
