"""Global `jax.Array`s to per-host numpy blocks and back (runs in the device owner).

A host receives its distinct index blocks of an input (replicated shards once) as one numpy
array, provided they form a hyper-rectangle of the global array: its bounding box. Outputs are
cut by the target sharding's per-device indices, relative to the host's bounding box, and put
on the devices; `jax.make_array_from_single_device_arrays` assembles the global array. On CPU,
`device_put` aliases 64-byte-aligned arena memory instead of copying it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from colocar import jax_compat
from colocar.errors import ArrayLayoutError


def index_bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A shard's index as ((start, stop), ...) over every dimension of `shape` (dimensions the
    index leaves out are whole); strided indices are refused."""
    bounds = []
    for s, n in zip(index, shape, strict=False):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ArrayLayoutError("strided shardings are not supported")
        bounds.append((start, stop))
    return tuple(bounds) + tuple((0, n) for n in shape[len(bounds) :])


@dataclass(frozen=True)
class HostLayout:
    """Where one host's part of a global array lies."""

    start: tuple[int, ...]
    shape: tuple[int, ...]
    blocks: dict[tuple[tuple[int, int], ...], list[Any]]  # distinct index -> devices holding it

    def local(self, bounds: tuple[tuple[int, int], ...]) -> tuple[slice, ...]:
        return tuple(slice(a - s, b - s) for (a, b), s in zip(bounds, self.start, strict=True))


_LAYOUTS: dict[tuple[Any, ...], HostLayout | None] = {}  # see `host_layout`
_LAYOUTS_KEPT = 1024


def host_layout(
    sharding: Any, shape: tuple[int, ...], devices: Sequence[Any], what: str
) -> HostLayout | None:
    """The bounding box of the blocks that `devices` hold; None if they hold none.

    Raises ArrayLayoutError when the distinct blocks do not fill their bounding box. Computed
    once per sharding, shape and devices (~30 us; an array call asks for every input and output
    on every host, and a program repeats the same few): the layouts returned are shared, read them only.
    """
    key = (sharding, tuple(shape), tuple(devices))
    if key in _LAYOUTS:
        return _LAYOUTS[key]
    layout = _host_layout(sharding, shape, devices, what)
    if len(_LAYOUTS) >= _LAYOUTS_KEPT:
        _LAYOUTS.clear()
    _LAYOUTS[key] = layout
    return layout


def _host_layout(
    sharding: Any, shape: tuple[int, ...], devices: Sequence[Any], what: str
) -> HostLayout | None:
    index_map = sharding.devices_indices_map(tuple(shape))
    blocks: dict[tuple[tuple[int, int], ...], list[Any]] = {}
    for device in devices:
        if device in index_map:
            blocks.setdefault(index_bounds(index_map[device], shape), []).append(device)
    if not blocks:
        return None
    ndim = len(shape)
    start = tuple(min(b[d][0] for b in blocks) for d in range(ndim))
    stop = tuple(max(b[d][1] for b in blocks) for d in range(ndim))
    box = tuple(b - a for a, b in zip(start, stop, strict=True))
    volume = sum(int(np.prod([b - a for a, b in bounds])) for bounds in blocks)
    if volume != int(np.prod(box)):
        raise ArrayLayoutError(
            f"{what}: the shards on this host do not form one rectangular block of the global array "
            f"(blocks {sorted(blocks)}); use a sharding whose per-host part is a hyper-rectangle "
            "(host-major device order, as cluster.mesh builds, or jax.devices() in its order under "
            "multi-controller JAX), or specialize(per_device_shards=True)"
        )
    return HostLayout(start, box, blocks)


ALIAS_ALIGN = 64  # bytes: JAX on CPU aliases numpy memory aligned so in `device_put`


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised array whose memory `device_put` aliases on CPU (numpy's own
    allocations are 16-byte aligned, which JAX copies)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIAS_ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIAS_ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


# Serialises colocar's own shard reads (calls submitted from several threads on one new array).
_shard_read = threading.Lock()


def addressable_shards(x: jax.Array) -> list[Any]:
    """x's addressable shards (`jax.Array.addressable_shards`), checked complete.

    jaxlib builds an array's per-device buffers at their first access and JAX keeps the first
    shard list it makes; two threads making that first access together can leave a partial or
    doubled list (4 or 16 shards of 8, with devices missing), which JAX then keeps. colocar
    reads shards under one lock, array calls once on the caller's thread (the plan), and the
    result must name each addressable device once: a broken list is an error, never a missing
    or wrong block."""
    with _shard_read:
        shards = list(x.addressable_shards)
    _check_complete(x, [s.device for s in shards])
    return shards


def by_device(x: jax.Array) -> dict[Any, jax.Array]:
    """x's addressable shards' data (single-device arrays) by device, checked complete as
    `addressable_shards` is. They are read with `addressable_data`: through x's `Shard`s they
    cost twice as much on a new array (~75 against ~37 us for 8 devices here: each shard asks
    its single-device array's sharding for the device). A replicated array's one copy stands
    for every device's (the same bytes; ~7 us)."""
    if x.is_fully_replicated:
        return dict.fromkeys(x.sharding.addressable_devices, x.addressable_data(0))
    count = len(x.sharding.addressable_devices)
    with _shard_read:
        try:
            data = [x.addressable_data(i) for i in range(count)]
        except IndexError:  # a partial list (see `addressable_shards`)
            data = []
    out = {next(iter(d.devices())): d for d in data}  # a device read twice counts once
    _check_complete(x, list(out))
    return out


def _check_complete(x: jax.Array, devices: list[Any]) -> None:
    """Raises unless `devices` (of x's shards as read) are x's addressable devices, once each."""
    expected: set[Any] = set(x.sharding.addressable_devices)
    if len(devices) != len(expected) or set(devices) != expected:
        raise ArrayLayoutError(
            f"JAX lists {len(devices)} addressable shards (on devices {sorted(d.id for d in devices)}) "
            f"of an array whose sharding {x.sharding} puts one on each of devices "
            f"{sorted(d.id for d in expected)} of this process: its shard list was first read "
            "from two threads at once, which leaves JAX holding a broken one; read a new array's "
            "x.addressable_shards on one thread before sharing it between threads"
        )


def gather(shards: Mapping[Any, jax.Array], layout: HostLayout, out: np.ndarray) -> None:
    """Copies the host's distinct shards of an array (`by_device`) into `out` (its bounding
    box): one copy each."""
    for bounds, devices in layout.blocks.items():
        data = next((shards[d] for d in devices if d in shards), None)
        if data is None:
            raise ArrayLayoutError(f"no addressable shard for block {bounds} of an input")
        out[layout.local(bounds)] = np.asarray(data)


def key_data(x: Any) -> Any:
    """A typed PRNG key array as its key data (`jax.random.key_data`: uint32, one trailing
    dimension more, sharded like the keys); anything else unchanged. Colocated functions receive
    keys this way, as checkpoints store them: numpy has no key dtype."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(x)
    return x


def per_device(shards: Mapping[Any, jax.Array], devices: Sequence[Any]) -> list[np.ndarray]:
    """An array's shards (`by_device`) on `devices`, in that order (for `per_device_shards=True`)."""
    return [np.asarray(shards[d]) for d in devices if d in shards]


def assemble(
    shape: tuple[int, ...],
    dtype: Any,
    sharding: Any,
    host_blocks: Mapping[int, tuple[Sequence[Any], np.ndarray]],
    what: str,
) -> jax.Array:
    """A global array from per-host blocks (host index -> (host devices, block))."""
    index_map = sharding.devices_indices_map(tuple(shape))
    pieces, targets = [], []
    for devices, block in host_blocks.values():
        layout = host_layout(sharding, shape, devices, what)
        if layout is None:
            continue
        block = np.asarray(block)
        if block.shape != layout.shape:
            raise ArrayLayoutError(
                f"{what}: a host returned shape {block.shape} but its part of the output "
                f"{tuple(shape)} under {sharding} is {layout.shape}; return the host's block, or "
                "give out_specs_fn"
            )
        if block.dtype != np.dtype(dtype):
            raise ArrayLayoutError(
                f"{what}: a host returned dtype {block.dtype}, the spec says {np.dtype(dtype)}"
            )
        for device in devices:
            if device in index_map:
                pieces.append(block[layout.local(index_bounds(index_map[device], shape))])
                targets.append(device)
    missing = set(sharding.addressable_devices) - set(targets)
    if missing:
        raise ArrayLayoutError(
            f"{what}: its sharding {sharding} puts shards on devices "
            f"{sorted(d.id for d in missing)}, which no host of the call holds; shard outputs over "
            "the devices of the call's array inputs"
        )
    return _put(tuple(shape), np.dtype(dtype), sharding, pieces, targets)


def _put(
    shape: tuple[int, ...], dtype: np.dtype, sharding: Any, pieces: list[Any], targets: list[Any]
) -> jax.Array:
    """The global array of one piece per device (aliased on CPU where aligned, as device_put
    does): in one call of JAX's batched put when this JAX has it (for 8 small pieces ~65 us
    against ~380 for device_put of each and make_array_from_single_device_arrays), else so."""
    batched, order = jax_compat.batched_put(), jax_compat.sharding_device_order(sharding)
    if (
        batched is not None
        and order is not None
        and len(order) == len(targets)
        and set(order) == set(targets)
        and jax.dtypes.canonicalize_dtype(dtype) == dtype  # else device_put converts it
    ):
        piece_of = dict(zip(targets, pieces, strict=True))
        views = [np.asarray(piece_of[d]) for d in order]  # a 0-d block's piece is a numpy scalar
        return batched.put(batched.aval(shape, dtype), sharding, views, order)
    arrays = jax.device_put(pieces, targets)
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def infer_output_shape(
    in_shape: tuple[int, ...], in_box: tuple[int, ...], out_box: tuple[int, ...], what: str
) -> tuple[int, ...]:
    """Global shape of an output that keeps the first input's sharding (the default rule).

    A dimension the input does not split keeps the host's size; a split one must keep the
    input's block size. Anything else needs `out_specs_fn`.
    """
    if len(out_box) != len(in_box):
        raise ArrayLayoutError(
            f"{what}: output rank {len(out_box)} differs from the first array input's rank "
            f"{len(in_box)}; give out_specs_fn to say how the output is sharded"
        )
    shape = []
    for n, box, out in zip(in_shape, in_box, out_box, strict=True):
        if box == n:
            shape.append(out)
        elif out == box:
            shape.append(n)
        else:
            raise ArrayLayoutError(
                f"{what}: a host returned shape {out_box} for an input block of {in_box} along a "
                "sharded dimension; give out_specs_fn to say the output's global shape"
            )
    return tuple(shape)
