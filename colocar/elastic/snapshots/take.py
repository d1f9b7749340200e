"""Taking a snapshot: replica placement, the fit check, shards device -> arena (controller).

A snapshot reuses the checkpoint's save planning (`checkpoint.saves.plan.plan`: one piece per
distinct shard, replicated shards once) with one piece per shard, and its copy (`copy_into`:
one memcpy into an arena block of the shard's host, split over the copy threads). What a host
must hold is its own shards plus the replicas it receives; a snapshot that does not fit some
host's pool is skipped with a warning naming the sizes, before any block is taken.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import uuid
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import jax
import numpy as np

from colocar.checkpoint.format import tree
from colocar.checkpoint.saves import plan as save
from colocar.controller_bridge.arrays import by_device
from colocar.errors import HostLostError, SnapshotError
from colocar.shm import ArenaFullError
from colocar.shm.allocator import footprint

from .keepers import stitch
from .keepers.peers import send_chunks

WHOLE_SHARD = 1 << 62  # plan's chunk limit: one piece per shard
LAYOUTS_KEPT = 8  # layouts a `Snapshots` remembers (`plan`)
Placement = Callable[[list[int], int], dict[int, list[int]]]


class SnapshotSkipped(UserWarning):
    """A snapshot was not taken (it does not fit an arena pool); training goes on."""


def ring(hosts: list[int], replicas: int) -> dict[int, list[int]]:
    """Each host's replicas go to the next `replicas` hosts in ring order."""
    n = len(hosts)
    return {h: [hosts[(i + k) % n] for k in range(1, replicas + 1)] for i, h in enumerate(hosts)}


def placement_of(place: Placement, hosts: list[int], replicas: int) -> dict[int, list[int]]:
    """`place(hosts, replicas)`, checked: every host gets `replicas` distinct other hosts."""
    targets = place(hosts, replicas)
    for h in hosts:
        got = list(targets.get(h, []))
        if len(set(got)) != replicas or h in got or not set(got) <= set(hosts):
            raise ValueError(
                f"replica placement gave host {h} the peers {got}; it needs {replicas} distinct "
                f"other hosts among {hosts}"
            )
    return {h: list(targets[h]) for h in hosts}


class _Among:
    """The cluster as `save.plan` sees it: only `hosts` (the live ones), so that host-side
    leaves (numpy arrays) go to the first of them."""

    def __init__(self, cluster: Any, hosts: list[int]):
        self.hosts = [h for h in cluster.hosts if h.index in hosts]
        self.host_of = cluster.host_of


@dataclass
class Planned:
    """A snapshot's plan: pieces per host, peers per host, the record once it commits."""

    step: int
    pieces: dict[int, list[save.Piece]]
    targets: dict[int, list[int]]
    record: dict[str, Any]
    own: dict[int, int] = field(default_factory=dict)  # host -> bytes of its shards
    need: dict[int, int] = field(default_factory=dict)  # host -> arena bytes incl. replicas received
    packed: dict[int, tuple[list[int], int]] = field(default_factory=dict)  # host -> `packed_offsets`
    leaves: list[Any] = field(default_factory=list)  # the state's leaves, in tree order


@dataclass
class _Layout:
    """What a plan derives from the state's shapes, dtypes and shardings alone: the leaves'
    entries, each host's pieces (sources unbound: (piece, device)), their record entry, bytes
    and block size. It holds no array: a cached layout must not keep a state's shards alive."""

    leaves: dict[str, dict[str, Any]]
    pieces: dict[int, list[tuple[save.Piece, Any]]]
    shards: dict[int, list[tuple[int, Any]]]
    own: dict[int, int]
    packed: dict[int, tuple[list[int], int]]


def plan(
    step: int,
    state: Any,
    cluster: Any,
    hosts: list[int],
    replicas: int,
    place: Placement,
    layouts: dict[Any, _Layout] | None = None,
) -> Planned:
    """The pieces of `state` per host and the record a restore needs (tree, leaf metadata,
    non-array leaves pickled, which shard each host holds). `layouts`: a cache of the parts
    that depend only on the arrays' shapes, dtypes and shardings (one per `Snapshots`: a
    training loop snapshots the same layout every few steps)."""
    named, skeleton, dirs = tree.flatten(state)
    arrays = [(k, v) for k, v in named if tree.is_array(v)]
    values = {k: v for k, v in named if not tree.is_array(v)}
    layout = _layout(step, arrays, dirs, cluster, hosts, {} if layouts is None else layouts)
    pieces = _bind(layout, arrays)
    targets = placement_of(place, hosts, replicas) if replicas else {h: [] for h in hosts}
    record = {
        "step": step,
        "attempt": uuid.uuid4().hex,
        "time": time.time(),
        "keys": [k for k, _ in named],
        "tree": skeleton,
        "leaves": layout.leaves,
        "values": _pickled(step, values),
        "shards": layout.shards,
        "replicas": targets,
        "jax_version": jax.__version__,
    }
    result = Planned(step, pieces, targets, record, dict(layout.own), packed=layout.packed)
    result.leaves = [leaf for _, leaf in named]
    result.need = dict(result.own)
    for h, peers in targets.items():
        for t in peers:
            result.need[t] += result.own[h]
    return result


def _layout(
    step: int,
    arrays: list[tuple[str, Any]],
    dirs: dict[str, str],
    cluster: Any,
    hosts: list[int],
    cache: dict,
) -> _Layout:
    described = tuple(
        (k, tree.is_prng_key(v), type(v), v.shape, v.dtype, getattr(v, "sharding", None)) for k, v in arrays
    )
    key = (described, tuple(hosts))
    found = cache.get(key)
    if found is not None:
        return found
    planned = save.plan(arrays, dirs, _Among(cluster, hosts), WHOLE_SHARD)
    for h in planned.pieces:
        if h not in hosts and planned.pieces[h]:
            raise HostLostError(
                f"snapshot of step {step}: host {h} holds shards of the state but is lost; "
                "restore onto the surviving hosts first"
            )
    pieces = {h: planned.pieces.get(h, []) for h in hosts}
    layout = _Layout(
        planned.leaves,
        {h: [(_unbound(p), _device_of(p.source)) for p in ps] for h, ps in pieces.items()},
        {h: [(p.leaf, p.bounds) for p in ps] for h, ps in pieces.items()},
        {h: sum(footprint(p.nbytes) for p in ps) for h, ps in pieces.items()},
        {h: packed_offsets(ps) for h, ps in pieces.items()},
    )
    if len(cache) >= LAYOUTS_KEPT:
        cache.clear()
    cache[key] = layout
    return layout


def _unbound(piece: save.Piece) -> save.Piece:
    """The piece without its source; `local` () when it is all of its source (as a snapshot's
    pieces are: whole shards), which `_on_host` then takes as it is."""
    whole = all(s.start == 0 and s.stop == n for s, n in zip(piece.local, piece.shape, strict=True))
    return dataclasses.replace(piece, source=None, local=() if whole else piece.local)


def _device_of(source: Any) -> Any:
    return next(iter(source.devices())) if isinstance(source, jax.Array) else None


def _bind(layout: _Layout, arrays: list[tuple[str, Any]]) -> dict[int, list[save.Piece]]:
    """The layout's pieces with the sources of these arrays: each device's shard (replica 0),
    a numpy leaf as it is, a PRNG key's key data."""
    sources: dict[int, Any] = {}
    out: dict[int, list[save.Piece]] = {}
    for h, entries in layout.pieces.items():
        out[h] = []
        for p, device in entries:
            if p.leaf not in sources:
                sources[p.leaf] = _sources_of(arrays[p.leaf][1])
            source = sources[p.leaf](device)
            out[h].append(save.Piece(p.leaf, p.bounds, source, p.local, p.shape, p.dtype))
    return out


def _sources_of(leaf: Any) -> Callable[[Any], Any]:
    """device -> the single-device data of `leaf` there (any device: the same bytes)."""
    data = jax.random.key_data(leaf) if tree.is_prng_key(leaf) else leaf
    if not isinstance(data, jax.Array):
        host = np.asarray(data)
        return lambda _: host
    return by_device(data).__getitem__


def _pickled(step: int, values: dict[str, Any]) -> bytes:
    """The plain (non-array) leaves, pickled by value; an error names the leaf that cannot be."""
    try:
        return cloudpickle.dumps(values)
    except Exception:  # noqa: BLE001 - find the leaf to name
        pass
    for key, value in values.items():
        try:
            cloudpickle.dumps(value)
        except Exception as e:
            raise SnapshotError(
                f"snapshot of step {step}: leaf {key} ({type(value).__name__}) cannot be stored: {e}"
            ) from e
    return cloudpickle.dumps(values)


def misfit(planned: Planned, pools: dict[int, dict[str, int]], pool: str) -> str | None:
    """Why the snapshot cannot fit (naming host, sizes and pool), or None."""
    for h, need in planned.need.items():
        stats = pools[h]
        free = stats["reserved"] - stats["used"]
        if need > free:
            return (
                f"snapshot of step {planned.step} skipped: host {h} needs {need} bytes in arena pool "
                f"{pool!r} ({planned.own[h]} of its shards + {need - planned.own[h]} of replicas it "
                f"receives) but the pool holds {stats['reserved']} bytes with {free} free; training "
                "goes on. Give the snapshots a larger pool (or arena), or fewer replicas"
            )
    return None


def skip(reason: str) -> bool:
    warnings.warn(reason, SnapshotSkipped, stacklevel=3)
    return False


def _on_host(pieces: list[save.Piece]) -> list[np.ndarray]:
    """Each piece's data in host memory (all device-to-host copies started first, unless the
    devices are the host's CPU: their buffers are host memory already)."""
    on_devices = [p.source for p in pieces if isinstance(p.source, jax.Array)]
    if on_devices and next(iter(on_devices[0].devices())).platform != "cpu":  # a host's devices are one kind
        for source in on_devices:
            source.copy_to_host_async()
    return [np.asarray(p.source)[p.local] if p.local else np.asarray(p.source) for p in pieces]


def packed_offsets(pieces: list[save.Piece]) -> tuple[list[int], int]:
    """Where each piece starts in its host's block, and the block's size."""
    return stitch.packed_offsets([piece.nbytes for piece in pieces])


def place(
    host: Any,
    pieces: list[save.Piece],
    pool: str,
    copiers: Executor | None,
    block: np.ndarray | None = None,
    packed: tuple[list[int], int] | None = None,
) -> Placed:
    """`pieces` copied into `block` (an empty one of their packed size) or one new block of
    `host`'s arena pool (one Allocate, no waiting: a full pool raises ArenaFullError), each
    at its offset (`packed`: their `packed_offsets`, known); the block stays the controller's
    until handed on (`hand`)."""
    sources = _on_host(pieces)
    offsets, total = packed or packed_offsets(pieces)
    if not pieces:
        return Placed(None, [])
    if block is None or block.nbytes != total:
        (block,) = host.connection.blocks.empty([((total,), np.dtype(np.uint8))], pool=pool, timeout=0.0)
    views = [np.ndarray(p.shape, p.dtype, block, o) for p, o in zip(pieces, offsets, strict=True)]
    save.copy_into(list(zip(views, sources, strict=True)), copiers)
    return Placed(block, offsets)


@dataclass
class Placed:
    """One host's pieces in one arena block (None: the host holds no piece), at `offsets`."""

    block: np.ndarray | None
    offsets: list[int]


def hand(keeper: Any, step: int, pieces: list[save.Piece], placed: Placed) -> Any:
    """The placed block to the host's keeper, which starts replicating its pieces: the call,
    in flight (its future)."""
    if placed.block is None:
        return keeper.write.submit(step, [], 0)
    return keeper.write_packed.submit(step, placed.block, layout_of(pieces, placed))


def layout_of(pieces: list[save.Piece], placed: Placed) -> list[tuple[Any, ...]]:
    """(leaf, bounds, byte offset, shape, dtype) of each piece in its host's block."""
    return [(p.leaf, p.bounds, o, p.shape, p.dtype) for p, o in zip(pieces, placed.offsets, strict=True)]


def send(
    host: Any,
    keeper: Any,
    step: int,
    attempt: str,
    pieces: list[save.Piece],
    pool: str,
    copiers: Executor | None,
) -> int:
    """Copies `pieces` into `host`'s arena and hands them to its keeper at once; without a
    mapped arena they go to the keeper in chunks (`peers.send_chunks`). Returns the bytes."""
    if not host.connection.blocks.mapped:  # chunks straight into blocks of the snapshot pool
        items = [(p.leaf, p.bounds, s) for p, s in zip(pieces, _on_host(pieces), strict=True)]
        sent = send_chunks(keeper, step, attempt, host.index, items)
        keeper.finish(step, len(pieces))
        return sent
    hand(keeper, step, pieces, place(host, pieces, pool, copiers)).result()
    return sum(p.nbytes for p in pieces)


def on_each(
    pool: Executor | None, fn: Callable[[int], Any], hosts: Iterable[int]
) -> tuple[dict[int, Any], dict]:
    """`fn(h)` for every host at once on `pool` (None: one after the other in this thread):
    (the results, the ArenaFullError of each host whose pool was full). Every call ended
    before this returns; any other error is raised."""
    calls = {h: pool.submit(fn, h).result if pool else functools.partial(fn, h) for h in hosts}
    results, full, error = {}, {}, None
    for h, call in calls.items():
        try:
            results[h] = call()
        except ArenaFullError as e:
            full[h] = e
        except BaseException as e:
            error = error or e
    if error is not None:
        raise error
    return results, full
