"""The blocking part of a save: plan the step, copy shards device -> arena (runs in the controller).

`plan` turns the state into manifest entries and, per host, the pieces it will write: one
piece per outer chunk of each distinct shard (replicated shards once, by the host holding
replica 0). `send` starts the device-to-host copies a window ahead, copies each piece into an
arena block of its host's sidecar (one memcpy; on CPU the shard is host memory already) and
hands the blocks to that host's writer; when the arena is full it waits for the writers to
free blocks (backpressure), and counts that time.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from colocar.controller_bridge.arrays import addressable_shards, index_bounds
from colocar.errors import CheckpointError
from colocar.shm import ArenaFullError

from ..format import layout, tree

PREFETCH_BYTES = 256 << 20  # device-to-host copies started ahead of the one being placed
BATCH_BYTES = 16 << 20  # pieces allocated and handed to a writer together when the arena is short
COPY_PART_BYTES = 8 << 20  # a larger copy is split by rows over the copy threads
INLINE_COPY_BYTES = 1 << 20  # a smaller one is done by the calling thread (a hand-over costs more)


@dataclass
class Piece:
    leaf: int
    bounds: list[list[int]]  # in the stored array
    source: Any  # a single-device jax.Array or a numpy array
    local: tuple[slice, ...]  # of `source`
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class Plan:
    leaves: dict[str, dict[str, Any]] = field(default_factory=dict)  # manifest entries by key
    pieces: dict[int, list[Piece]] = field(default_factory=dict)  # host index -> pieces


def shard_bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[list[int]]:
    """[[start, stop], ...] of a shard (or a device's slice) of an array of `shape`, as stored."""
    return [list(b) for b in index_bounds(index, shape)]


def _chunk_grid(bounds: list[list[int]], chunk: tuple[int, ...]) -> Iterator[list[list[int]]]:
    """The outer chunks inside one shard's bounds (one, empty, for an empty shard)."""
    ranges = [
        [[a, min(a + c, hi)] for a in range(lo, hi, c)] if hi > lo else [[lo, hi]]
        for (lo, hi), c in zip(bounds, chunk, strict=True)
    ]
    for combo in itertools.product(*ranges):
        yield [list(r) for r in combo]


def _array_entry(index: int, key: str, leaf: Any, directory: str) -> tuple[dict[str, Any], Any]:
    """An array leaf's first manifest fields (its kind and shape) and the array stored for it
    (a PRNG key's key data)."""
    entry: dict[str, Any] = {"index": index, "key": key, "dir": directory}
    if tree.is_prng_key(leaf):
        entry.update(kind="prng_key", impl=str(jax.random.key_impl(leaf)), shape=list(leaf.shape))
        return entry, jax.random.key_data(leaf)
    if isinstance(leaf, jax.Array):
        entry.update(kind="array", shape=list(leaf.shape))
        return entry, leaf
    data = np.asarray(leaf)
    entry.update(kind="numpy", shape=list(data.shape))
    return entry, data


def plan(
    named: list[tuple[str, Any]],
    dirs: dict[str, str],
    cluster: Any,
    max_chunk_bytes: int,
    host_data: bool = True,
) -> Plan:
    """Manifest entries for every leaf and the pieces each host of `cluster` writes: the
    addressable replica-0 shards of JAX arrays, and numpy leaves when `host_data` (only one
    process of a multi-controller job writes those). `dirs`: each array leaf's directory under
    `arrays/` by key (`tree.flatten`)."""
    result = Plan()
    primary = cluster.hosts[0].index
    for index, (key, leaf) in enumerate(named):
        if not tree.is_array(leaf):
            result.leaves[key] = {
                "kind": "value",
                "index": index,
                "key": key,
                "value": tree.json_value(key, leaf),
            }
            continue
        entry, data = _array_entry(index, key, leaf, dirs[key])
        dtype = np.dtype(data.dtype)
        shape = tuple(int(n) for n in data.shape)
        entry.update(
            dtype=str(np.dtype(leaf.dtype)) if entry["kind"] != "prng_key" else "key",
            stored_dtype=dtype.name,
            stored_shape=list(shape),
        )
        if isinstance(data, jax.Array):
            entry["sharding"] = tree.sharding_to_json(leaf.sharding)
            shard_shape = tuple(data.sharding.shard_shape(shape))
            shards = [
                (s.data, shard_bounds(s.index, shape), cluster.host_of(s.device), s.device)
                for s in addressable_shards(data)
                if s.replica_id == 0
            ]
        else:
            entry["sharding"] = None
            shard_shape = shape
            shards = [(data, [[0, n] for n in shape], cluster.hosts[0], None)] if host_data else []
        outer, inner = layout.chunk_shapes(shard_shape, dtype.itemsize, max_chunk_bytes)
        entry.update(chunks=list(outer), inner_chunks=list(inner))
        for source, bounds, host, device in shards:
            if host is None:
                raise CheckpointError(f"{key}: device {device} belongs to no host of the cluster")
            for piece in _chunk_grid(bounds, outer):
                local = tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(piece, bounds, strict=True))
                result.pieces.setdefault(host.index, []).append(
                    Piece(index, piece, source, local, tuple(b - a for a, b in piece), dtype)
                )
        result.leaves[key] = entry
    result.pieces.setdefault(primary, [])
    return result


def _prefetched(pieces: list[Piece]) -> Iterator[Piece]:
    """Yields pieces while device-to-host copies run up to PREFETCH_BYTES ahead."""
    started: set[int] = set()
    ahead: deque[Piece] = deque()
    ahead_bytes = 0
    queue = iter(pieces)
    while True:
        for piece in queue:
            source = piece.source
            if isinstance(source, jax.Array) and id(source) not in started:
                started.add(id(source))
                source.copy_to_host_async()
            ahead.append(piece)
            ahead_bytes += piece.nbytes
            if ahead_bytes >= PREFETCH_BYTES:
                break
        if not ahead:
            return
        piece = ahead.popleft()
        ahead_bytes -= piece.nbytes
        yield piece


@dataclass
class SendStats:
    bytes: int = 0
    pieces: int = 0
    arena_waits: int = 0  # pieces that found the arena full
    arena_wait_seconds: float = 0.0
    finished: bool = False  # the writer was told the total with the last pieces (no `finish`)


def _groups(pieces: Iterator[Piece], limit: int = BATCH_BYTES) -> Iterator[list[Piece]]:
    """Consecutive pieces of at most `limit` bytes (or one larger piece)."""
    group: list[Piece] = []
    size = 0
    for piece in pieces:
        if group and size + piece.nbytes > limit:
            yield group
            group, size = [], 0
        group.append(piece)
        size += piece.nbytes
    if group:
        yield group


def copy_into(
    pairs: list[tuple[np.ndarray, Any]], copiers: Executor | None, part_bytes: int = COPY_PART_BYTES
) -> None:
    """`np.copyto(block, source)` for each pair, split by rows into `part_bytes` parts run on
    `copiers` (numpy drops the GIL while it copies, so one host's copy uses several cores);
    parts under INLINE_COPY_BYTES are copied by the calling thread."""
    parts: list[tuple[np.ndarray, Any]] = []
    for block, source in pairs:
        n = min(block.shape[0], block.nbytes // part_bytes) if block.ndim and copiers else 1
        if n <= 1:
            parts.append((block, source))
            continue
        cuts = [block.shape[0] * i // n for i in range(n + 1)]
        parts += [(block[a:b], source[a:b]) for a, b in itertools.pairwise(cuts)]
    shared = copiers is not None and sum(b.nbytes >= INLINE_COPY_BYTES for b, _ in parts) > 1
    futures, inline = [], []
    for block, source in parts:
        if shared and block.nbytes >= INLINE_COPY_BYTES:
            futures.append(copiers.submit(np.copyto, block, source))  # type: ignore[union-attr]
        else:
            inline.append((block, source))
    for block, source in inline:
        np.copyto(block, source)
    for future in futures:
        future.result()


def send(
    host: Any,
    writer: Any,
    step: int,
    pieces: list[Piece],
    pool: str,
    check: Any,
    copiers: Executor | None = None,
) -> tuple[list, SendStats]:
    """Copies `pieces` into `host`'s arena and hands them to its writer; returns the call
    futures (each completes once the writer queued its blocks) and the stats.

    When the arena has room for all of them, the writer gets them in one call after the last
    copy, which also tells it they were all (`stats.finished`): the copies (on `copiers`) then
    have the cores to themselves. Otherwise they go in BATCH_BYTES groups as blocks free up;
    `check()` raises when the save failed meanwhile (so a full arena never waits on a dead
    save). A host without shared memory gets the pieces uploaded by the write calls, a group
    per call."""
    conn = host.connection
    stats = SendStats()
    if not conn.blocks.mapped:
        groups = _groups(_prefetched(pieces))
        return [writer.write.submit(step, _items(g, None, copiers, stats)) for g in groups], stats
    try:
        blocks = (
            conn.blocks.empty([(p.shape, p.dtype) for p in pieces], pool=pool, timeout=0.0) if pieces else []
        )
    except ArenaFullError:
        return _send_as_room_frees(conn, writer, step, pieces, pool, check, copiers, stats), stats
    blocks.reverse()
    items = []
    for group in _groups(_prefetched(pieces), PREFETCH_BYTES):
        items += _items(group, [blocks.pop() for _ in group], copiers, stats)
    if not items:
        return [], stats
    stats.finished = True
    return [writer.write.submit(step, items, len(items))], stats


def _items(
    group: list[Piece], blocks: list[np.ndarray] | None, copiers: Executor | None, stats: SendStats
) -> list:
    """(leaf, bounds, data) for the writer: arena blocks filled from the pieces, or (without
    blocks) contiguous host copies that the call uploads."""
    sources = [np.asarray(piece.source)[piece.local] for piece in group]
    if blocks is None:
        data = [np.asarray(source, order="C") for source in sources]  # (ascontiguousarray makes 0-d 1-d)
    else:
        copy_into(list(zip(blocks, sources, strict=True)), copiers)
        data = blocks
    stats.bytes += sum(piece.nbytes for piece in group)
    stats.pieces += len(group)
    return [(piece.leaf, piece.bounds, d) for piece, d in zip(group, data, strict=True)]


def _send_as_room_frees(
    conn: Any,
    writer: Any,
    step: int,
    pieces: list[Piece],
    pool: str,
    check: Any,
    copiers: Executor | None,
    stats: SendStats,
) -> list:
    """The arena cannot hold the whole save: a group at a time, each handed over at once so the
    writer frees its blocks; a group that finds the arena full goes piece by piece, waiting."""
    futures = []
    for group in _groups(_prefetched(pieces)):
        try:
            blocks = conn.blocks.empty([(p.shape, p.dtype) for p in group], pool=pool, timeout=0.0)
        except ArenaFullError:
            stats.arena_waits += 1
            for piece in group:
                block = _wait_for_block(conn, piece, pool, stats, check)
                futures.append(writer.write.submit(step, _items([piece], [block], copiers, stats)))
                del block
            continue
        futures.append(writer.write.submit(step, _items(group, blocks, copiers, stats)))
        del blocks
    return futures


def _wait_for_block(conn: Any, piece: Piece, pool: str, stats: SendStats, check: Any) -> np.ndarray:
    """An arena block for `piece`, waiting while the arena is full, unless the save failed."""
    started = time.monotonic()
    try:
        while True:
            check()
            try:
                return conn.blocks.empty([(piece.shape, piece.dtype)], pool=pool, timeout=1.0)[0]
            except ArenaFullError:
                pass
    finally:
        stats.arena_wait_seconds += time.monotonic() - started
