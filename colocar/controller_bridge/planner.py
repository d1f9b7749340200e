"""Array calls planned per host, and their per-host results assembled (controller, no I/O).

A colocated call with `jax.Array` arguments runs on every host that holds part of them. Its
plan says which hosts take part and, for each, the block of each array argument it gets (the
bounding box of its shards, `arrays.host_layout`); `assemble` turns the hosts' results into
global arrays, sharded by `out_specs_fn` or by the default rule (the first array input's
sharding, each host returning its block). Functions and methods share this; staging and
calling are `array_calls.py`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from colocar.errors import ArrayLayoutError, ColocarError

from . import arrays
from .cluster import Host, addressable, host_of_device, where
from .specs import Options, check_in_specs, same_value, spec_of


@dataclass(frozen=True)
class HostPlan:
    """One host of a call and where its part of each array argument lies."""

    host: Host
    devices: tuple[Any, ...]  # the host's devices this JAX process owns (all, with one controller)
    layouts: tuple[arrays.HostLayout, ...]  # one per array argument; none with per-device shards


@dataclass(frozen=True)
class CallPlan:
    """What a call sends where: its flattened arguments and its hosts."""

    name: str  # qualified, for messages
    label: str  # as the user calls it (`f` in hints such as `f.specialize(...)`)
    options: Options
    leaves: tuple[Any, ...]  # the arguments' pytree leaves, PRNG keys as their key data
    treedef: Any
    positions: tuple[int, ...]  # where the jax.Array leaves are
    hosts: tuple[HostPlan, ...]
    in_specs: tuple[Any, Any]  # (args, kwargs) with arrays as ShapeDtypeStructs, for out_specs_fn
    # per array argument, its shards' data by device: read once, on the caller's thread (the
    # stagings run on several threads; see `arrays.addressable_shards`)
    shards_by_device: tuple[dict[Any, jax.Array], ...]

    @property
    def arrays(self) -> list[jax.Array]:
        return [self.leaves[i] for i in self.positions]

    def block_specs(self, host: HostPlan) -> list[tuple[tuple[int, ...], np.dtype]]:
        """Shape and dtype of the host's block of each array argument."""
        xs = self.arrays
        return [(layout.shape, np.dtype(x.dtype)) for x, layout in zip(xs, host.layouts, strict=True)]

    def fill(self, host: HostPlan, blocks: Sequence[np.ndarray]) -> None:
        """Copies the host's shards of each array argument into its block (device to host)."""
        for shards, layout, block in zip(self.shards_by_device, host.layouts, blocks, strict=True):
            arrays.gather(shards, layout, block)

    def shards(self, host: HostPlan) -> list[list[np.ndarray]]:
        """Each array argument as the list of its shards on the host (`per_device_shards`)."""
        return [arrays.per_device(shards, host.devices) for shards in self.shards_by_device]

    def arguments(self, values: Sequence[Any]) -> tuple[tuple, dict]:
        """The host's (args, kwargs): the arguments with `values` in place of the arrays."""
        leaves = list(self.leaves)
        for i, value in zip(self.positions, values, strict=True):
            leaves[i] = value
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def hosts_of(devices: Sequence[Any]) -> list[Host]:
    """The hosts of `devices`, in host order, each once."""
    hosts: dict[int, Host] = {}
    for device in devices:
        host = host_of_device(device)
        hosts.setdefault(id(host), host)
    return sorted(hosts.values(), key=lambda h: h.index)


def plan_call(name: str, label: str, options: Options, args: tuple, kwargs: dict) -> CallPlan:
    """The plan of a call; raises before anything is staged if the call cannot run.

    Only the devices this JAX process owns count (under multi-controller JAX every process
    calls with the same global arrays and runs on its own hosts); with one controller, all."""
    if options.in_specs is not None:
        check_in_specs(options.in_specs, args, kwargs, name)
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    leaves = [arrays.key_data(leaf) for leaf in leaves]
    positions = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array))
    if positions:
        devices = _local_devices(name, (args, kwargs), leaves, positions)
    elif options.devices is not None:
        devices = addressable(options.devices)
        if not devices:
            raise ColocarError(
                f"{name}: none of the devices given with specialize(devices=...) "
                f"({sorted(d.id for d in options.devices)}) belongs to {where()}; give each "
                "process devices that include its own (jax.devices() lists every process's)"
            )
    else:
        raise ValueError(
            f"{name} has no jax.Array arguments: give it devices with "
            f"{label}.specialize(devices=...), or call {label}.on(hosts)(...)"
        )
    in_specs = jax.tree_util.tree_map(spec_of, jax.tree_util.tree_unflatten(treedef, leaves))
    xs = [leaves[i] for i in positions]
    plans = []
    for host in hosts_of(devices):
        mine = tuple(addressable(host.devices))
        layouts = () if options.per_device_shards else _layouts(xs, host, mine, name)
        plans.append(HostPlan(host, mine, layouts))
    shards = tuple(arrays.by_device(x) for x in xs)
    return CallPlan(name, label, options, tuple(leaves), treedef, positions, tuple(plans), in_specs, shards)


def _local_devices(name: str, tree: Any, leaves: list[Any], positions: tuple[int, ...]) -> list[Any]:
    """The devices of this JAX process holding the array arguments; raises naming the argument
    and the processes holding it if one lies only on other processes' devices."""
    devices = []
    for i in positions:
        sharding = leaves[i].sharding
        mine = sorted(sharding.addressable_devices, key=lambda d: d.id)
        if not mine:
            paths = [_argument(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
            held = sorted(sharding.device_set, key=lambda d: d.id)
            raise ColocarError(
                f"{name}: array argument {paths[i]} has no shard on {where()}: it lies on devices "
                f"{[d.id for d in held]} of JAX processes {sorted({d.process_index for d in held})}. "
                "Under multi-controller JAX every process calls with the same global arrays and "
                "runs on its own devices' blocks: shard the array over every process's devices "
                "(a mesh of jax.devices()), or call only from the processes that hold it"
            )
        devices.extend(mine)
    return devices


def _argument(path: tuple[Any, ...]) -> str:
    """An (args, kwargs) leaf's path as the user wrote it: `args[0]`, `kwargs['params']['w']`."""
    return ("args" if path[0].idx == 0 else "kwargs") + jax.tree_util.keystr(path[1:])


def _layouts(
    xs: list[jax.Array], host: Host, devices: Sequence[Any], name: str
) -> tuple[arrays.HostLayout, ...]:
    layouts = []
    for x in xs:
        layout = arrays.host_layout(x.sharding, x.shape, devices, f"argument of {name}")
        if layout is None:
            raise ArrayLayoutError(
                f"{name}: an array argument has no shard on {host.name}, while another "
                "has; place all array arguments on the same devices"
            )
        layouts.append(layout)
    return tuple(layouts)


def assemble(plan: CallPlan, results: Sequence[tuple[HostPlan, Any]]) -> Any:
    """The global result from each host's result (in host order).

    Arrays (and every output `out_specs_fn` describes) become global `jax.Array`s; other values
    must be equal on every host. With `per_device_shards` the result is the hosts' list."""
    if plan.options.per_device_shards:
        return [value for _, value in results]
    name = plan.name
    trees = [jax.tree_util.tree_flatten(r, is_leaf=lambda x: x is None) for _, r in results]
    treedef = trees[0][1]
    if any(t[1] != treedef for t in trees):  # type: ignore[operator]
        raise ColocarError(f"{name} returned differently structured results on different hosts")
    n = len(trees[0][0])
    spec_leaves = _out_specs(plan, n)
    out = []
    for k in range(n):
        values = [t[0][k] for t in trees]
        spec = spec_leaves[k]
        if isinstance(values[0], np.ndarray | np.generic) or spec is not None:  # 0-d: a scalar
            out.append(_global(plan, values, results, spec, f"output {k} of {name}"))
        elif all(same_value(v, values[0]) for v in values):
            out.append(values[0])
        else:
            raise ColocarError(
                f"{name}: output {k} is a non-array value that differs between hosts; return "
                f"arrays, or call {plan.label}.on(hosts) to get one value per host"
            )
    return jax.tree_util.tree_unflatten(treedef, out)


def _out_specs(plan: CallPlan, n: int) -> list[Any]:
    """The spec of each of the n outputs (None for those the default rule shapes)."""
    if plan.options.out_specs_fn is None:
        return [None] * n
    specs_args, specs_kwargs = plan.in_specs
    spec_leaves = jax.tree_util.tree_leaves(plan.options.out_specs_fn(*specs_args, **specs_kwargs))
    if len(spec_leaves) != n:
        raise ColocarError(f"{plan.name}: out_specs_fn gave {len(spec_leaves)} outputs, the function {n}")
    return spec_leaves


def _global(
    plan: CallPlan, values: list[Any], results: Sequence[tuple[HostPlan, Any]], spec: Any, what: str
) -> jax.Array:
    blocks = {h.host.index: (h.devices, np.asarray(v)) for (h, _), v in zip(results, values, strict=True)}
    if spec is not None:
        return arrays.assemble(spec.shape, spec.dtype, spec.sharding, blocks, what)
    if not plan.positions:
        raise ColocarError(f"{what}: without array inputs, give out_specs_fn to say how outputs are sharded")
    first = plan.arrays[0]
    host0 = results[0][0]
    in_box = host0.layouts[0].shape if host0.layouts else first.shape
    shape = arrays.infer_output_shape(first.shape, in_box, np.asarray(values[0]).shape, what)
    return arrays.assemble(shape, np.asarray(values[0]).dtype, first.sharding, blocks, what)
