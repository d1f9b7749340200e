"""The topology strategies: who runs the training loop, one controller or one process per host.

`Manager` picks one at construction (`controllers_of`) and asks it instead of testing which
case it is in (runs in the controller). `SingleController` (`single.py`): this process drives
every host; a lost host is recovered in-process (the run function is called again on the
survivors) and hosts that come back rejoin. `MultiController` (`multi.py`: multi-controller
JAX, `jax.distributed`, each process on its own sidecar): a loss ends this trainer with an
`ElasticError` (it is restarted in place and resumes from the sidecars' RAM), the processes
agree on what `restore` reads, and the snapshots carry their own bookkeeping
(`MultiSnapshotTier`). The snapshot store's own multi-controller side is `snapshots/multi/`.
"""

from __future__ import annotations

from .multi import MultiController
from .single import SingleController


def controllers_of(sync_timeout: float = 300.0) -> SingleController | MultiController:
    """`MultiController` when this process is one of several JAX processes."""
    import jax

    return MultiController(sync_timeout) if jax.process_count() > 1 else SingleController()


__all__ = ["MultiController", "SingleController", "controllers_of"]
