"""The sidecar's arena: allocation, the numpy views shipped functions see, payload coding.

Runs in the sidecar process. Blocks are leased: a controller session holds a lease on each
block it allocated or received; every live numpy view in this process holds one lease under
the owner "view". A block is freed when its last lease goes (views release through a
`Reclaimer`, since finalizers may run anywhere). Payloads are coded by `protocol.payload`
over the blocks leased to one owner (`_Leases`).
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any

import numpy as np

from colocar.protocol import colocar_pb2 as pb
from colocar.protocol import payload
from colocar.protocol.payload import BoundsError, Encoded
from colocar.shm import (
    HEADER_BYTES,
    Allocator,
    Arena,
    Block,
    UnknownBlockError,
    holds,
    ndarray_view,
    remove_stale_arenas,
)
from colocar.shm.allocator import footprint
from colocar.shm.reclaim import Reclaimer
from colocar.shm.ring import SlotRing
from colocar.shm.views import BlockHandle

VIEW_OWNER = "view"

__all__ = ["VIEW_OWNER", "BoundsError", "Encoded", "SidecarArena"]


class SidecarArena:
    """Owns the arena file and its allocator for the life of the sidecar."""

    def __init__(self, shm_dir: str, size: int, pools: dict[str, int] | None = None, label: str = "sidecar"):
        self.stale_removed = remove_stale_arenas(shm_dir)
        self.arena = Arena.create(shm_dir, size, label=label)
        self.allocator = Allocator(HEADER_BYTES, size - HEADER_BYTES, pools or {})
        self._reclaimer = Reclaimer(self._release_views, name="colocar-view-reclaimer")
        self._holdings = _CallHoldings()

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
        self,
        shape: int | tuple[int, ...],
        dtype: Any,
        pool: str = "default",
        timeout: float = 0.0,
        call: object | None = None,
    ) -> np.ndarray:
        """A new uninitialised array in the arena (returning it to the controller copies nothing).

        `call` names the running call: while it waits for room it cannot give back the arrays it
        made here and still holds, so a request that cannot fit beside them fails at once."""
        dtype = np.dtype(dtype)
        if not holds(dtype):  # checked before allocating: a failed view must not leak the block
            raise TypeError(f"dtype {dtype} cannot live in the arena; use np.empty")
        shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
        nbytes = math.prod(shape) * dtype.itemsize  # Python ints: no int64 wrap-around
        pinned = 0 if call is None else self._holdings.held(call, pool)
        block = self.allocator.allocate(nbytes, owner=VIEW_OWNER, pool=pool, timeout=timeout, pinned=pinned)
        array = self._make_view(block, shape, dtype)
        if call is not None:
            self._holdings.add(call, array, pool, footprint(nbytes))
        return array

    def _make_view(self, block: Block, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        return ndarray_view(
            self.arena,
            block.offset,
            shape,
            dtype,
            on_release=lambda: self._reclaimer.push(block),
            handle=BlockHandle(block.id, self.arena),
        )

    def _release_views(self, blocks: list[Block]) -> None:
        for block in blocks:
            self.allocator.release(block.id, VIEW_OWNER)

    def ring(self, slots: int, nbytes: int, pool: str = "default", timeout: float = 0.0) -> SlotRing:
        """A ring of `slots` reusable blocks of `nbytes` (see `colocar.shm.ring`)."""
        return SlotRing(self.allocator, self.view, slots, nbytes, pool=pool, timeout=timeout)

    def flush(self) -> None:
        """Waits until views that died so far have released their blocks."""
        self._reclaimer.flush()

    # --- payloads --------------------------------------------------------------------------
    def decode(self, payload_: pb.Payload, owner: str) -> Any:
        """Unpickles a payload; its blocks must be leased by `owner` (bounds check)."""
        descs = payload_.blocks
        blocks = [self.check(desc, owner) for desc in descs] if descs else ()
        return payload.decode(payload_.pickle, blocks, self.view)

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

    def encode(
        self,
        value: Any,
        owner: str,
        what: str = "result",
        timeout: float = 0.0,
        into: pb.Payload | None = None,
    ) -> Encoded:
        """Pickles a value (into the reply's payload field `into`, if given); its large arrays
        end up in blocks leased to `owner` (one copy at most).

        An array that is already a whole local view shares its block. Whether that is safe is
        only known once the caller has dropped `value`: finish with `hand_over`.
        """
        return payload.encode(_Leases(self, owner, timeout), value, what, into=into)

    def hand_over(self, encoded: Encoded, owner: str, timeout: float = 0.0) -> pb.Payload:
        """The payload to send, once the caller dropped its references to the encoded value
        (see `protocol.payload.hand_over`: shared blocks this process still reaches are copied)."""
        if not encoded.shared:  # nothing to decide (most calls): no space to build
            return encoded.payload
        return payload.hand_over(_Leases(self, owner, timeout), encoded)

    def discard(self, encoded: Encoded, owner: str) -> None:
        """Gives back the leases an encoded value took (it will not be sent)."""
        payload.discard(_Leases(self, owner), encoded)

    def close(self) -> None:
        self._reclaimer.close()
        self.arena.unlink()
        self.arena.close()


class _Leases(payload.BlockSpace):
    """The sidecar's blocks as one owner's payloads see them: every block a payload names
    (allocated, or shared from a local view) carries a lease of `owner`."""

    def __init__(self, arena: SidecarArena, owner: str, timeout: float = 0.0):
        self.arena = arena.arena
        self._allocator = arena.allocator
        self._owner = owner
        self._timeout = timeout

    def allocate_one(self, nbytes: int) -> pb.BlockDesc:
        block = self._allocator.allocate(nbytes, owner=self._owner, timeout=self._timeout)
        return pb.BlockDesc(id=block.id, offset=block.offset, nbytes=nbytes)

    def allocate(self, sizes: list[int]) -> list[pb.BlockDesc]:
        """All or none; a payload that cannot fit the pool fails at once (no wait helps)."""
        blocks = self._allocator.allocate_all(sizes, owner=self._owner, timeout=self._timeout)
        return [pb.BlockDesc(id=b.id, offset=b.offset, nbytes=b.nbytes) for b in blocks]

    def release(self, descs: list[pb.BlockDesc]) -> None:
        for desc in descs:
            self._allocator.release(desc.id, self._owner)

    def share(self, block_id: int, offset: int, nbytes: int) -> pb.BlockDesc:
        """A lease on the block for the payload, which names the region [offset, +nbytes) of
        it (the whole block, or a `views.shareable` part)."""
        block = self._allocator.acquire(block_id, self._owner)
        if not block.offset <= offset <= offset + nbytes <= block.offset + block.nbytes:
            self._allocator.release(block_id, self._owner)
            raise ValueError(f"region {offset}+{nbytes} is not within block {block_id}")
        return pb.BlockDesc(id=block.id, offset=offset, nbytes=nbytes)

    unshare = release


class _CallHoldings:
    """The arrays each call made with `SidecarArena.empty` and still holds (weakly), by call:
    what that call cannot give back while it waits for room (`Allocator.allocate`'s `pinned`)."""

    SWEEP_AT = 256  # calls remembered before those whose arrays all died are forgotten

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # id(call) -> (call, [(array, pool, bytes taken)]); the call is kept so its id stays its own
        self._calls: dict[int, tuple[object, list[tuple[weakref.ref, str, int]]]] = {}

    def held(self, call: object, pool: str) -> int:
        with self._lock:
            entry = self._calls.get(id(call))
            return 0 if entry is None else sum(n for ref, p, n in entry[1] if p == pool and ref() is not None)

    def add(self, call: object, array: np.ndarray, pool: str, taken: int) -> None:
        with self._lock:
            if len(self._calls) >= self.SWEEP_AT:
                for key, (_, arrays) in list(self._calls.items()):
                    if all(ref() is None for ref, _, _ in arrays):
                        del self._calls[key]
            entry = self._calls.setdefault(id(call), (call, []))
            entry[1][:] = [h for h in entry[1] if h[0]() is not None] + [(weakref.ref(array), pool, taken)]
