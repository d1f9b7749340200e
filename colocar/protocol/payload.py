"""Values as payloads: a pickle plus the arena blocks its large arrays live in (every process).

One codec for the three places that put arrays in blocks and take them out again: the
controller's arena client, the sidecar's arena and a call worker. Each supplies a `BlockSpace`,
its way to allocate, fill, share and give back blocks; the rules are written once here:

- `encode` pickles a value (`serialization.dumps`); an array that is exactly a view of a block
  the space leased (its `BlockHandle` names the space's `home`) is shared, every other large
  array is copied once into a block allocated for the payload. Whatever the payload took is
  given back if encoding fails (`discard`).
- `hand_over`, once the caller dropped its own references to the value: a shared block that an
  array of this process still reaches (an object or a cache kept it) could be written after the
  receiver got it, changing a returned `jax.Array`, so it is copied first (see `views.reach`).
- `decode` unpickles, asking the space for a view of each referenced block.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np

from colocar.shm import Arena, copy_into
from colocar.shm.views import handle_of, reach

from . import colocar_pb2 as pb
from . import serialization

T = TypeVar("T")


class BoundsError(ValueError):
    """A descriptor or an array reference does not fit the blocks sent."""


class BlockSpace:
    """One process's access to an arena's blocks, as the codec needs it.

    Subclasses implement `allocate` (or `allocate_one`), `release` and `view`; a space whose
    payloads take a lease of their own on a shared block (the sidecar's) also `share` and
    `unshare`. `home` is the identity that this space's `BlockHandle`s carry.
    """

    arena: Arena | None = None

    @property
    def home(self) -> object:
        return self.arena

    def allocate_one(self, nbytes: int) -> pb.BlockDesc:
        raise NotImplementedError

    def allocate(self, sizes: list[int]) -> list[pb.BlockDesc]:
        """Blocks for a payload, all or none."""
        return all_or_none(sizes, self.allocate_one, self.release)

    def release(self, descs: list[pb.BlockDesc]) -> None:
        """Gives back blocks allocated for a payload that will not be sent."""
        raise NotImplementedError

    def share(self, block_id: int, offset: int, nbytes: int) -> pb.BlockDesc:
        """The payload's descriptor of a block this space holds (and a lease for it, if the
        payload needs one of its own)."""
        return pb.BlockDesc(id=block_id, offset=offset, nbytes=nbytes)

    def unshare(self, descs: list[pb.BlockDesc]) -> None:
        """Gives back what `share` took."""

    def view(self, desc: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        raise NotImplementedError

    def place(self, arrays: list[np.ndarray]) -> list[pb.BlockDesc]:
        """One copy of each array into a fresh block; nothing stays allocated on failure."""
        descs = self.allocate([array.nbytes for array in arrays])
        try:
            for desc, array in zip(descs, arrays, strict=True):
                copy_into(self.arena, desc.offset, array)  # type: ignore[arg-type]
        except BaseException:  # interrupted: no receiver will take them
            self.release(descs)
            raise
        return descs

    def bytes_of(self, desc: pb.BlockDesc) -> np.ndarray:
        """A block's bytes, read in place (no lease: the caller holds one)."""
        assert self.arena is not None
        return np.frombuffer(self.arena.buffer(desc.offset, desc.nbytes), np.uint8)


class Encoded:
    """An encoded value: its payload; which of its blocks were allocated for it (`fresh`) and
    which are shared, with the reach of the sharing view (`shared`, see `hand_over`); and, when
    asked for, the arrays it references (the controller keeps them until the call completed,
    so that a release of a block it shares cannot overtake the call). A plain class: a call
    without arrays pays for little more than its pickle."""

    __slots__ = ("payload", "fresh", "shared", "arrays")

    def __init__(self, payload: pb.Payload):
        self.payload = payload
        self.fresh: list[int] = []
        self.shared: list[tuple[int, weakref.ref | None]] = []
        self.arrays: list[np.ndarray] = []

    def fresh_ids(self) -> list[int]:
        if not self.fresh:
            return []
        blocks = self.payload.blocks
        return [blocks[i].id for i in self.fresh]


def encode(
    space: BlockSpace, value: Any, what: str, keep: bool = False, into: pb.Payload | None = None
) -> Encoded:
    """Pickles `value`; its large arrays end up in blocks (one copy at most, one `allocate`).

    Sharing is only known to be safe once the caller dropped `value`: a sender that gives
    blocks away finishes with `hand_over`. `keep` returns the referenced arrays too. `into`
    is the (empty) payload field of the message that will carry it: filled in place, not copied.
    """
    arrays: list[np.ndarray] = []

    def sink(array: np.ndarray) -> int:
        arrays.append(array)
        return len(arrays) - 1

    pickled = serialization.dumps(value, sink, what=what)
    if into is None:
        into = pb.Payload(pickle=pickled)
    else:
        into.pickle = pickled
    encoded = Encoded(into)
    if not arrays:
        return encoded
    descs: list[pb.BlockDesc | None] = [None] * len(arrays)
    home = space.home
    try:
        for i, array in enumerate(arrays):
            found = handle_of(array) if home is not None else None
            if found is not None and found[0].home is home:
                descs[i] = space.share(found[0].id, found[1], found[2])
                encoded.shared.append((i, reach(array)))
            else:
                encoded.fresh.append(i)
        if encoded.fresh:
            placed = space.place([arrays[i] for i in encoded.fresh])
            for i, desc in zip(encoded.fresh, placed, strict=True):
                descs[i] = desc
    except BaseException:
        space.unshare([descs[i] for i, _ in encoded.shared])  # type: ignore[misc]
        raise
    encoded.payload.blocks.extend(descs)  # type: ignore[arg-type]
    if keep:
        encoded.arrays = arrays
    return encoded


def hand_over(space: BlockSpace, encoded: Encoded) -> pb.Payload:
    """The payload to send, once the caller dropped its references to the encoded value.

    A shared block that some array in this process still reaches is copied to a fresh block
    first; a block nothing here reaches any more goes as it is (a fresh `colocar.shm.empty`
    result, a returned input). On failure everything the payload took is given back.
    """
    blocks = encoded.payload.blocks
    try:
        while encoded.shared:
            index, view = encoded.shared[-1]
            if view is not None and view() is not None:
                old = pb.BlockDesc()
                old.CopyFrom(blocks[index])
                (new,) = space.place([space.bytes_of(old)])
                blocks[index].CopyFrom(new)
                encoded.fresh.append(index)
                encoded.shared.pop()
                space.unshare([old])
            else:
                encoded.shared.pop()
    except BaseException:
        discard(space, encoded)
        raise
    return encoded.payload


def discard(space: BlockSpace, encoded: Encoded) -> None:
    """Gives back what an encoded value took (it will not be sent)."""
    blocks = encoded.payload.blocks
    shared, fresh = encoded.shared[:], encoded.fresh[:]
    encoded.shared.clear()
    encoded.fresh.clear()
    try:
        space.unshare([blocks[i] for i, _ in shared])
        space.release([blocks[i] for i in fresh])
    finally:
        del blocks[:]


def decode(
    data: bytes,
    blocks: Sequence[T],
    view: Callable[[T, tuple[int, ...], np.dtype], np.ndarray],
    used: set[int] | None = None,
) -> Any:
    """Unpickles a payload's pickle; each array reference becomes `view(blocks[i], shape,
    dtype)`. `used` collects the indices referenced (the blocks no array took are the
    caller's to give back)."""

    if not blocks:  # the common small call: no closure to build
        return serialization.loads(data, _no_blocks)

    def source(index: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if not 0 <= index < len(blocks):
            raise BoundsError(f"array reference {index} but only {len(blocks)} blocks sent")
        if used is not None:
            used.add(index)
        return view(blocks[index], shape, dtype)

    return serialization.loads(data, source)


def _no_blocks(index: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    raise BoundsError(f"array reference {index} but only 0 blocks sent")


def all_or_none(
    items: Iterable[T], make: Callable[[T], pb.BlockDesc], release: Callable[[list[pb.BlockDesc]], None]
) -> list[pb.BlockDesc]:
    """`make(item)` for each item; if one fails (or is interrupted), the blocks made so far go
    to `release` and the error propagates."""
    descs: list[pb.BlockDesc] = []
    try:
        for item in items:
            descs.append(make(item))
    except BaseException:
        release(descs)
        raise
    return descs
