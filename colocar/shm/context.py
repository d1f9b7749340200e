"""`colocar.shm.empty`: allocate a result directly in the arena of the current sidecar.

Inside a shipped function, an array made with `empty` lives in the sidecar's arena, so
returning it to the controller copies nothing. Elsewhere (plain Python, tests, the
controller) it is an ordinary `np.empty`, so the same function runs anywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .views import holds

Allocate = Callable[[tuple[int, ...], np.dtype, str], np.ndarray]
_allocate: Allocate | None = None
_runtime: Any = None


def install(allocate: Allocate | None, runtime: Any = None) -> None:
    """Called by the sidecar (and its worker processes) at start-up; `runtime` is the sidecar's
    arena (`colocar.sidecar.blocks.SidecarArena`), given in the sidecar process only."""
    global _allocate, _runtime
    _allocate, _runtime = allocate, runtime


def sidecar_runtime() -> Any:
    """The sidecar's arena, for sidecar-side libraries (rings of slots, arena facts).

    Only inside a sidecar process, in a thread-mode call: not in worker processes, not elsewhere.
    """
    if _runtime is None:
        raise RuntimeError("this needs to run inside a colocar sidecar (a thread-mode colocated call)")
    return _runtime


def empty(shape: int | tuple[int, ...], dtype: Any = np.float32, pool: str = "default") -> np.ndarray:
    """An uninitialised C-contiguous array, in the arena when running on a sidecar.

    Object-like dtypes (`object`, `StringDType`) cannot live in the arena: they get an
    ordinary array (returned results of those dtypes are pickled).
    """
    shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
    if _allocate is None or not holds(dtype):
        return np.empty(shape, dtype)
    return _allocate(shape, np.dtype(dtype), pool)


def in_sidecar() -> bool:
    """True when running inside a sidecar process or one of its workers."""
    return _allocate is not None
