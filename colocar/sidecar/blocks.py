"""The sidecar's arena: allocation, the numpy views shipped functions see, payload coding.

Runs in the sidecar process. Blocks are leased: a controller session holds a lease on each
block it allocated or received; every live numpy view in this process holds one lease under
the owner "view". A block is freed when its last lease goes (views release through a
`Reclaimer`, since finalizers may run anywhere).
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from colocar.protocol import colocar_pb2 as pb
from colocar.protocol import serialization
from colocar.shm import (
    HEADER_BYTES,
    Allocator,
    Arena,
    Block,
    UnknownBlockError,
    block_of,
    copy_into,
    holds,
    ndarray_view,
    remove_stale_arenas,
)
from colocar.shm.reclaim import Reclaimer
from colocar.shm.ring import SlotRing
from colocar.shm.views import reach

VIEW_OWNER = "view"


@dataclass
class Encoded:
    """A payload whose shared blocks (index in `payload.blocks`, reach of the sharing view) may
    still be reachable from this process; see `SidecarArena.hand_over`."""

    payload: pb.Payload
    shared: list[tuple[int, weakref.ref | None]] = field(default_factory=list)


class BoundsError(ValueError):
    """A descriptor does not fit the block it names."""


class SidecarArena:
    """Owns the arena file and its allocator for the life of the sidecar."""

    def __init__(self, shm_dir: str, size: int, pools: dict[str, int] | None = None, label: str = "sidecar"):
        self.stale_removed = remove_stale_arenas(shm_dir)
        self.arena = Arena.create(shm_dir, size, label=label)
        self.allocator = Allocator(HEADER_BYTES, size - HEADER_BYTES, pools or {})
        self._view_blocks: dict[int, int] = {}  # offset -> block id, for live local views
        self._view_lock = threading.Lock()
        self._reclaimer = Reclaimer(self._release_views, name="colocar-view-reclaimer")

    # --- views -----------------------------------------------------------------------------
    def view(self, block: Block, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A zero-copy array over `block`, holding a lease until the array and its views die."""
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        # Checked before the lease is taken: a malformed reference must not leak the block.
        if not holds(dtype) or any(d < 0 for d in shape):
            raise BoundsError(f"array {shape} {dtype} cannot be a view of arena bytes")
        nbytes = math.prod(shape) * dtype.itemsize  # Python ints: no int64 wrap-around
        if nbytes > block.nbytes:
            raise BoundsError(
                f"array {shape} {dtype} needs {nbytes} bytes but block {block.id} holds {block.nbytes}"
            )
        self.allocator.acquire(block.id, VIEW_OWNER)
        try:
            return self._make_view(block, shape, dtype)
        except BaseException:
            self.allocator.release(block.id, VIEW_OWNER)
            raise

    def empty(
        self, shape: tuple[int, ...], dtype: Any, pool: str = "default", timeout: float = 0.0
    ) -> np.ndarray:
        """A new uninitialised array in the arena (returning it to the controller copies nothing)."""
        dtype = np.dtype(dtype)
        if not holds(dtype):  # checked before allocating: a failed view must not leak the block
            raise TypeError(f"dtype {dtype} cannot live in the arena; use np.empty")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        block = self.allocator.allocate(nbytes, owner=VIEW_OWNER, pool=pool, timeout=timeout)
        return self._make_view(block, tuple(shape), dtype)

    def _make_view(self, block: Block, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        with self._view_lock:
            self._view_blocks[block.offset] = block.id
        return ndarray_view(
            self.arena, block.offset, shape, dtype, on_release=lambda: self._reclaimer.push(block)
        )

    def _release_views(self, blocks: list[Block]) -> None:
        for block in blocks:
            with self._view_lock:
                if self._view_blocks.get(block.offset) == block.id:
                    del self._view_blocks[block.offset]
            self.allocator.release(block.id, VIEW_OWNER)

    def ring(self, slots: int, nbytes: int, pool: str = "default", timeout: float = 0.0) -> SlotRing:
        """A ring of `slots` reusable blocks of `nbytes` (see `colocar.shm.ring`)."""
        return SlotRing(self.allocator, self.view, slots, nbytes, pool=pool, timeout=timeout)

    def block_of_view(self, array: np.ndarray) -> int | None:
        """Block id of an array that is exactly a live local view, else None."""
        found = block_of(array)
        if found is None or found[0] is not self.arena:
            return None
        with self._view_lock:
            return self._view_blocks.get(found[1])

    def flush(self) -> None:
        """Waits until views that died so far have released their blocks."""
        self._reclaimer.flush()

    # --- payloads --------------------------------------------------------------------------
    def decode(self, payload: pb.Payload, owner: str) -> Any:
        """Unpickles a payload; its blocks must be leased by `owner` (bounds check)."""
        blocks = [self.check(desc, owner) for desc in payload.blocks]

        def source(index: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
            if not 0 <= index < len(blocks):
                raise BoundsError(f"array reference {index} but only {len(blocks)} blocks sent")
            return self.view(blocks[index], shape, dtype)

        return serialization.loads(payload.pickle, source)

    def check(self, desc: pb.BlockDesc, owner: str) -> Block:
        try:
            block = self.allocator.check(desc.id, owner)
        except UnknownBlockError:
            raise BoundsError(f"block {desc.id} is not leased by this session") from None
        if desc.offset != block.offset or desc.nbytes > block.nbytes:
            raise BoundsError(
                f"descriptor (offset {desc.offset}, {desc.nbytes} bytes) does not match block "
                f"{desc.id} (offset {block.offset}, {block.nbytes} bytes)"
            )
        return block

    def encode(self, value: Any, owner: str, what: str = "result", timeout: float = 0.0) -> Encoded:
        """Pickles a value; its large arrays end up in blocks leased to `owner` (one copy at most).

        An array that is already a whole local view shares its block. Whether that is safe is
        only known once the caller has dropped `value`: finish with `hand_over`.
        """
        encoded = Encoded(pb.Payload())

        def sink(array: np.ndarray) -> int:
            block_id = self.block_of_view(array)
            if block_id is not None:  # already in the arena: share the block, copy nothing
                block = self.allocator.acquire(block_id, owner)
                encoded.shared.append((len(encoded.payload.blocks), reach(array)))
            else:
                block = self.allocator.allocate(array.nbytes, owner=owner, timeout=timeout)
                copy_into(self.arena, block.offset, array)
            encoded.payload.blocks.append(pb.BlockDesc(id=block.id, offset=block.offset, nbytes=array.nbytes))
            return len(encoded.payload.blocks) - 1

        try:
            encoded.payload.pickle = serialization.dumps(value, sink, what=what)
        except BaseException:
            self.discard(encoded, owner)
            raise
        return encoded

    def hand_over(self, encoded: Encoded, owner: str, timeout: float = 0.0) -> pb.Payload:
        """The payload to send, once the caller dropped its references to the encoded value.

        A shared block that some array in this process still reaches (an object or a cache kept
        it, a generator's frame holds it) could be written after the caller got it, changing a
        returned `jax.Array`: such a block is copied to a fresh one first. A block nothing here
        reaches any more goes as it is (a fresh `colocar.shm.empty` result, a returned input).
        """
        blocks = encoded.payload.blocks
        try:
            for index, view in encoded.shared:
                if view is None or view() is None:
                    continue
                old_id, old_offset, nbytes = blocks[index].id, blocks[index].offset, blocks[index].nbytes
                new = self.allocator.allocate(nbytes, owner=owner, timeout=timeout)
                self.arena.buffer(new.offset, nbytes)[:] = self.arena.buffer(old_offset, nbytes)
                blocks[index].CopyFrom(pb.BlockDesc(id=new.id, offset=new.offset, nbytes=nbytes))
                self.allocator.release(old_id, owner)
        except BaseException:
            self.discard(encoded, owner)
            raise
        encoded.shared.clear()
        return encoded.payload

    def discard(self, encoded: Encoded, owner: str) -> None:
        """Gives back the leases an encoded value took (it will not be sent)."""
        for desc in encoded.payload.blocks:
            self.allocator.release(desc.id, owner)
        del encoded.payload.blocks[:]

    def close(self) -> None:
        self._reclaimer.close()
        self.arena.unlink()
        self.arena.close()
