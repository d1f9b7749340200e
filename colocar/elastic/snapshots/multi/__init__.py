"""The snapshot store under multi-controller JAX: one process per host (runs in the controller).

`store.py` (`MultiSnapshots`: each process snapshots its own shards into its own sidecar),
`agree.py` (the processes agree on snapshots through jax.distributed's key-value store),
`refill.py` (a process's pieces, and the refill of a replaced sidecar), `restore.py` (each
process builds its devices' slices) and `save.py` (storage saves written by each process's
sidecar from its blocks). The single-controller store is the package above.
"""
