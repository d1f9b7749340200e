"""The host-memory snapshot store: `Snapshots` and, under multi-controller JAX, `MultiSnapshots`.

The store (`store.py`, runs in the controller) takes a snapshot (`take.py`: placement, the fit
check, shards device -> arena), hands its blocks to the keepers (`handoff.py`), waits for the
replicas and commits it in the background (`commit.py`), restores it from the survivors
(`restore.py`, with the slice cover of `slices.py`) and saves it to storage from its blocks
(`save.py`). `multi/` is the multi-controller side: each JAX process snapshots its own host
(`multi/store.py`), the processes agree through jax.distributed (`multi/agree.py`), refill a
replaced host (`multi/refill.py`), restore onto another layout (`multi/restore.py`) and save
from the blocks (`multi/save.py`). `keepers/` runs in the sidecars: the detached keepers that
hold the blocks (`keepers/keeper.py`, `keepers/multi.py`), the slices cut from them
(`keepers/stitch.py`) and the sidecar-to-sidecar transfer (`keepers/peers.py`).

Nothing is imported here until asked for: a sidecar imports `keepers/` without JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .multi.store import MultiSnapshots
    from .store import Snapshots

__all__ = ["MultiSnapshots", "Snapshots"]


def __getattr__(name: str) -> Any:
    import importlib

    if name == "Snapshots":
        return importlib.import_module(".store", __name__).Snapshots
    if name == "MultiSnapshots":
        return importlib.import_module(".multi.store", __name__).MultiSnapshots
    raise AttributeError(f"module 'colocar.elastic.snapshots' has no attribute {name!r}")
