"""The checkpoint's sidecar side: detached objects in each host's sidecar (no JAX).

`writer.py` (`CheckpointWriter`: one per manager and host, writing every save of that manager
from the arena blocks the controller hands it), `primary.py` (host 0's writer: waits for every
host's done marker, commits, applies retention), `fencing.py` (fencing the writers of a root's
earlier lease holders), `trainer_watch.py` (a save whose trainer went away before handing over
its part fails at once) and `reader.py` (the slices a host's devices need, read into arena
blocks).
"""
