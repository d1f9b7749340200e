"""Shared memory between the sidecar and processes on its host.

One pre-faulted arena file per sidecar (``arena``), an allocator of aligned, leased
blocks in isolated pools (``allocator``, sidecar only), and zero-copy numpy views over
arena bytes (``views``, any process). Depends on numpy only: no JAX, no gRPC.
"""

from .allocator import Allocator, ArenaFullError, Block, OwnerEndedError, UnknownBlockError
from .arena import HEADER_BYTES, Arena, ShmUnavailableError, remove_stale_arenas
from .context import empty, in_sidecar
from .views import arena_offset, block_of, copy_into, holds, ndarray_view

__all__ = [
    "HEADER_BYTES",
    "Allocator",
    "Arena",
    "ArenaFullError",
    "Block",
    "OwnerEndedError",
    "ShmUnavailableError",
    "UnknownBlockError",
    "arena_offset",
    "block_of",
    "copy_into",
    "empty",
    "holds",
    "in_sidecar",
    "ndarray_view",
    "remove_stale_arenas",
]
