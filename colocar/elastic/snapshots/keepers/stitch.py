"""Slices of a snapshot's leaf cut from the blocks that hold parts of it, and blocks (in a keeper).

A keeper holds each leaf as blocks at their bounds in the global array (its own shards and
replicas of its peers'); a read asks for a slice: a contiguous part of one block is handed
out as it is (`within`), any other is filled by `stitch` into a new arena array from every
block that overlaps it. `unpack` cuts a packed block (a take's, or the pieces a peer sent
in one call) into its pieces, `allocate` gives a replica its block. Shared by the single-
and multi-controller keepers.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

Bounds = tuple[tuple[int, int], ...]  # ((start, stop), ...) in the global array
ALIGN = 64  # bytes: where each piece starts in a packed block


def packed_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Where pieces of `sizes` bytes start in one packed block (each at an ALIGN multiple),
    and the block's size."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // ALIGN) * ALIGN
    return offsets, total


def by_leaf(held: list[dict[tuple[int, Bounds], np.ndarray]]) -> dict[int, list[tuple[np.ndarray, Bounds]]]:
    """Blocks keyed (leaf, bounds), from several holdings, as each leaf's (block, bounds): the
    parts `stitch` takes, grouped once for all requests. A key held twice (a replicated array's
    shard, its own and a peer's replica: the same bytes) counts once, from the first holding."""
    seen: set[tuple[int, Bounds]] = set()
    out: dict[int, list[tuple[np.ndarray, Bounds]]] = {}
    for blocks in held:
        for (leaf, bounds), data in blocks.items():
            if (leaf, bounds) not in seen:
                seen.add((leaf, bounds))
                out.setdefault(leaf, []).append((data, bounds))
    return out


def within(want: Bounds, parts: list[tuple[np.ndarray, Bounds]]) -> np.ndarray | None:
    """Slice `want` as a view of the one block of `parts` that holds it whole, when that slice
    is contiguous memory (e.g. rows of a row-major block): shared by the reply, not copied
    (`shm.views.shareable`). None otherwise (then `stitch`)."""
    from colocar.shm.views import shareable

    for data, held in parts:
        if all(c <= a and b <= d for (a, b), (c, d) in zip(want, held, strict=True)):
            part = data[tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(want, held, strict=True))]
            return shareable(part) if data.ndim else None
    return None


def stitch(want: Bounds, dtype: Any, parts: list[tuple[np.ndarray, Bounds]]) -> tuple[np.ndarray, int]:
    """A new arena array for slice `want`, filled from the parts of `parts` (blocks at their
    bounds) inside it, and how many elements they covered (the caller refuses a shortfall)."""
    import ml_dtypes  # noqa: F401 - registers bfloat16 & co. with numpy

    from colocar.shm import empty

    result = empty(tuple(b - a for a, b in want), np.dtype(dtype))
    return result, sum(_copy_overlap(result, want, data, held) for data, held in parts)


def _copy_overlap(out: np.ndarray, want: Bounds, data: np.ndarray, held: Bounds) -> int:
    """Copies the part of block `data` (at `held` bounds) inside `want` into `out`; returns the
    elements copied."""
    lo = [max(a, c) for (a, _), (c, _) in zip(want, held, strict=True)]
    hi = [min(b, d) for (_, b), (_, d) in zip(want, held, strict=True)]
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return 0
    dst = tuple(slice(a - w[0], b - w[0]) for a, b, w in zip(lo, hi, want, strict=True))
    src = tuple(slice(a - h[0], b - h[0]) for a, b, h in zip(lo, hi, held, strict=True))
    out[dst] = data[src]  # an assignment: a 0-d array's out[()] is no view to copy into
    return int(np.prod([b - a for a, b in zip(lo, hi, strict=True)], dtype=np.int64))


def unpack(block: np.ndarray, layout: list[tuple[Any, ...]]) -> list[tuple[Any, Any, np.ndarray]]:
    """The pieces (leaf, bounds, view) packed in one block at the layout's (leaf, bounds, byte
    offset, shape, dtype); dtype objects (unpickling one imports what registers it)."""
    flat = block.reshape(-1).view(np.uint8)
    pieces = []
    for leaf, bounds, offset, shape, dtype in layout:
        nbytes = nbytes_of(shape, dtype)
        pieces.append((leaf, bounds, flat[offset : offset + nbytes].view(dtype).reshape(shape)))
    return pieces


def packed_block(
    pieces: list[tuple[Any, Any, Any, Any, bytes]], pool: str
) -> list[tuple[Any, Any, np.ndarray]]:
    """Pieces (leaf, bounds, dtype, shape, their bytes) copied into one new block of `pool`,
    each at its packed offset: (leaf, bounds, view) of each (`unpack`)."""
    offsets, total = packed_offsets([len(data) for *_, data in pieces])
    block = allocate((total,), np.dtype(np.uint8), pool)
    for (*_, data), at in zip(pieces, offsets, strict=True):
        block[at : at + len(data)] = np.frombuffer(data, np.uint8)
    layout = [
        (leaf, bounds, at, shape, dtype)
        for (leaf, bounds, dtype, shape, _), at in zip(pieces, offsets, strict=True)
    ]
    return unpack(block, layout)


def nbytes_of(shape: Any, dtype: Any) -> int:
    """The bytes of an array of `shape` and `dtype` (math.prod: np.prod costs ~7 us, paid per
    piece of every replica received)."""
    return math.prod(shape) * as_dtype(dtype).itemsize


def as_dtype(dtype: Any) -> np.dtype:
    """numpy's dtype for `dtype` (a dtype, or a name such as "bfloat16")."""
    if not isinstance(dtype, np.dtype):  # a name ("bfloat16"): numpy learns it from ml_dtypes,
        import ml_dtypes  # noqa: F401 - whose import holds the GIL ~0.3 s, so only when needed
    return np.dtype(dtype)


def allocate(shape: tuple[int, ...], dtype: Any, pool: str) -> np.ndarray:
    """A block of the snapshot pool, at once or ArenaFullError (a snapshot never waits)."""
    dtype = as_dtype(dtype)

    from colocar.shm.context import sidecar_runtime

    try:
        arena = sidecar_runtime()
    except RuntimeError:  # not in a sidecar (a unit test of the class)
        return np.empty(shape, dtype)
    return arena.empty(shape, dtype, pool, timeout=0.0)
