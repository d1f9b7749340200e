"""A controller that starts a one-host local cluster, prints its sidecar's pid and arena path,
and waits (the test kills it without closing the cluster).

Run by test_cluster.py; no arguments.
"""

import sys
from typing import Any

import colocar

c: Any = colocar.local_cluster(hosts=1, arena_size=16 << 20, processes=0)
print(c.processes[0].pid, c.hosts[0].connection.session.info.arena_path, flush=True)
sys.stdin.read()
