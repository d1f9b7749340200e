"""Zero-copy numpy views over arena bytes (any process that has the arena mapped).

Every view's ``.base`` chain ends in a small holder of ours, which keeps the arena's
mapping alive and calls ``on_release`` once no array derived from the view is alive
any more (that is how a block's lease is returned). ``block_of`` finds the arena
region an array came from, so an array already in the arena is never copied again; a view
made with a ``BlockHandle`` also says which block it is and whose (``handle_of``), so that
whoever leased the block can share it without looking its address up anywhere.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from numpy.lib.array_utils import byte_bounds

from .arena import Arena


class BlockHandle(NamedTuple):
    """The block a view covers: its id, and ``home``, an identity token of whoever leased it
    (a controller's arena client, the sidecar's arena, a call worker's task). Only that owner's
    payload codec shares the block; to anyone else the view is plain bytes."""

    id: int
    home: object


class _Holder:
    """Owns one arena region for numpy: exposes it via ``__array_interface__``."""

    __slots__ = ("arena", "offset", "nbytes", "address", "handle", "_buffer", "_keep", "__weakref__")

    def __init__(
        self, arena: Arena, offset: int, nbytes: int, handle: BlockHandle | None, keep: object = None
    ) -> None:
        # The memoryview pins the mmap: the arena cannot be unmapped under live views.
        self._buffer = arena.buffer(offset, nbytes)
        self._keep = keep  # what must outlive this region (the view of the block it lies in)
        self.arena = arena
        self.offset = offset
        self.nbytes = nbytes
        self.address = arena.base_address + offset
        self.handle = handle

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return {
            "version": 3,
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.address, False),
        }


def holds(dtype: Any) -> bool:
    """Whether arrays of ``dtype`` can live in arena bytes: fixed-size items with no references.

    Object-like dtypes (``object``, ``np.dtypes.StringDType()``) store pointers to memory of
    this process only, and flexible dtypes without a size have no layout: such arrays travel
    pickled instead.
    """
    dtype = np.dtype(dtype)
    return not dtype.hasobject and dtype.itemsize > 0


def ndarray_view(
    arena: Arena,
    offset: int,
    shape: tuple[int, ...],
    dtype: Any,
    on_release: Callable[[], None] | None = None,
    handle: BlockHandle | None = None,
) -> np.ndarray:
    """A writable C-contiguous array over arena bytes [offset, offset + nbytes), no copy.

    ``on_release`` runs exactly once, when the last array derived from this view dies
    (not at interpreter exit if views are still alive then). It is a GC finalizer: it may
    run in any thread, inside any allocation, even one made under an Allocator's lock, so
    it must not take locks or block; hand the release to a ``reclaim.Reclaimer`` instead.
    ``handle`` names the block, for ``handle_of``.
    """
    dtype = np.dtype(dtype)
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    if dtype.hasobject:
        raise TypeError(f"dtype {dtype} holds references to Python objects and cannot live in the arena")
    if dtype.itemsize == 0:
        raise ValueError(f"dtype {dtype} has no size; give a sized dtype such as 'S8' or 'V16'")
    nbytes = math.prod(shape) * dtype.itemsize
    holder = _Holder(arena, offset, nbytes, handle)
    array = np.asarray(holder).view(dtype).reshape(shape)
    if on_release is not None:
        finalizer = weakref.finalize(holder, on_release)
        finalizer.atexit = False
    return array


def shareable(array: np.ndarray) -> np.ndarray | None:
    """`array`, a C-contiguous part of a view made with a ``BlockHandle``, as a view of its own
    region of that block, which the owner's payloads share (the receiver maps those bytes)
    instead of copying them; it keeps `array`, and so the block's lease, alive. None for any
    other array. Only for memory nobody writes again (a snapshot's blocks): the receiver, and
    a `jax.Array` built on it, read it for as long as they live."""
    holder = _holder_of(array)
    if holder is None or holder.handle is None or not array.flags.c_contiguous or array.size == 0:
        return None
    offset = holder.offset + array.__array_interface__["data"][0] - holder.address
    region = _Holder(holder.arena, offset, array.nbytes, holder.handle, keep=array)
    return np.asarray(region).view(array.dtype).reshape(array.shape)


def _holder_of(array: np.ndarray) -> _Holder | None:
    base: Any = array
    while isinstance(base, np.ndarray):
        base = base.base
    return base if isinstance(base, _Holder) else None


def reach(array: np.ndarray) -> weakref.ref | None:
    """A weak reference to the arena view ``array`` derives from: dead once no array over that
    view is alive in this process, i.e. nothing here can read or write it any more."""
    holder = _holder_of(array)
    return None if holder is None else weakref.ref(holder)


def _whole(array: Any) -> _Holder | None:
    """The holder of the view ``array`` covers exactly (C-contiguous, same start and size)."""
    if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
        return None
    holder = _holder_of(array)
    if holder is None:
        return None
    if array.__array_interface__["data"][0] != holder.address or array.nbytes != holder.nbytes:
        return None
    return holder


def block_of(array: np.ndarray) -> tuple[Arena, int, int] | None:
    """(arena, offset, nbytes) if ``array`` is C-contiguous over a whole ndarray_view region."""
    holder = _whole(array)
    return None if holder is None else (holder.arena, holder.offset, holder.nbytes)


def handle_of(array: np.ndarray) -> tuple[BlockHandle, int, int] | None:
    """(handle, offset, nbytes) if ``array`` covers exactly a view made with a handle."""
    holder = _whole(array)
    if holder is None or holder.handle is None:
        return None
    return holder.handle, holder.offset, holder.nbytes


def arena_offset(arena: Arena, array: np.ndarray) -> int | None:
    """Offset in ``arena`` of ``array``'s data if all its memory lies in this mapping, else None."""
    if not isinstance(array, np.ndarray):
        return None
    address = array.__array_interface__["data"][0]
    if array.size == 0:
        return address - arena.base_address if arena.contains(address, 0) else None
    low, high = byte_bounds(array)
    if not arena.contains(low, high - low):
        return None
    return address - arena.base_address


def copy_into(arena: Arena, offset: int, array: np.ndarray) -> None:
    """One copy of ``array`` (any layout) into arena bytes at ``offset``, C-contiguous."""
    target = np.frombuffer(arena.buffer(offset, array.nbytes), dtype=array.dtype)
    np.copyto(target.reshape(array.shape), array, casting="no")
