"""Async checkpoints written by the sidecars with tensorstore, to GCS or local disk.

`CheckpointManager(directory, cluster)` saves pytrees of `jax.Array`s: `save` blocks only for
the device-to-arena copies, the sidecars write zarr3 arrays and commit the step; `restore`
reads what each host's devices need for the target sharding; `abstract(tree)` makes a restore
target from a live (or abstract) state. Format: docs/checkpoints.md.
Layout: `manager.py` (`CheckpointManager`) and `restore.py` here, `saves/` (a save in the
controller), `backends/` (the sidecar side: writers and readers, no JAX), `store/` (storage,
step directories, the writer lease), `format/` (colocar's layout), `orbax/` (Orbax's), and the
`colocar ckpt` command (`cli.py`, `convert.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from colocar.errors import CheckpointError

    from .format.tree import abstract
    from .manager import CheckpointManager, SaveStats
    from .store.storage import StorageError

__all__ = ["CheckpointError", "CheckpointManager", "SaveStats", "StorageError", "abstract"]


def __getattr__(name: str) -> Any:
    if name in ("CheckpointManager", "SaveStats"):
        from . import manager

        return getattr(manager, name)
    if name == "CheckpointError":
        from colocar.errors import CheckpointError

        return CheckpointError
    if name == "abstract":
        from .format.tree import abstract

        return abstract
    if name == "StorageError":
        from .store.storage import StorageError

        return StorageError
    raise AttributeError(f"module 'colocar.checkpoint' has no attribute {name!r}")
