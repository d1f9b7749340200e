"""`@colocated`: ship a Python function to the sidecars (runs in the controller).

Two ways to call, mirroring `jax.experimental.colocated_python` where it has an equivalent:

* `f(x, ...)` with `jax.Array` arguments runs `f` on every host that holds part of them; each
  host gets its block of each array as one numpy array (see `arrays.py`), and array results
  come back as global `jax.Array`s, sharded by `out_specs_fn` or by the default rule (the first
  array input's sharding, each host returning its block). Without array arguments, `devices`
  must be given with `specialize`.
* `f.on(hosts)(...)` runs `f` on the given host(s) with plain Python values and returns plain
  values (one per host for a list of hosts). Generator functions stream their items.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np

from colocar.errors import ArrayLayoutError, ColocarError
from colocar.protocol import colocar_pb2 as pb
from colocar.shm import holds

from . import arrays
from .calls import Call, CallFuture, RemoteIterator, ShippedCode
from .cluster import Host, host_of_device


@dataclass(frozen=True)
class Options:
    """How a colocated function runs; `specialize` and the decorator set these."""

    in_specs: Any = None
    out_specs_fn: Callable[..., Any] | None = None
    devices: tuple[Any, ...] | None = None
    processes: bool = False
    timeout: float | None = None
    per_device_shards: bool = False
    prefetch: int = 2


def _hosts_for(devices: Sequence[Any]) -> list[Host]:
    hosts: dict[int, Host] = {}
    for device in devices:
        host = host_of_device(device)
        hosts.setdefault(id(host), host)
    return sorted(hosts.values(), key=lambda h: h.index)


class ColocatedFunction:
    """A function that runs on the sidecars; see the module docstring."""

    def __init__(self, fn: Callable[..., Any], code: ShippedCode, options: Options):
        self._fn = fn
        self._code = code
        self._options = options
        functools.update_wrapper(self, fn)
        self.__name__: str = getattr(fn, "__name__", "function")

    # --- configuration ---------------------------------------------------------------------
    def specialize(
        self,
        in_specs: Any = None,
        out_specs_fn: Callable[..., Any] | None = None,
        devices: Sequence[Any] | None = None,
        *,
        per_device_shards: bool | None = None,
        timeout: float | None = None,
    ) -> ColocatedFunction:
        """A copy with output specs, devices (for calls without array inputs) or other options."""
        o = self._options
        options = replace(
            o,
            in_specs=in_specs if in_specs is not None else o.in_specs,
            out_specs_fn=out_specs_fn or o.out_specs_fn,
            devices=tuple(devices) if devices is not None else o.devices,
            per_device_shards=o.per_device_shards if per_device_shards is None else per_device_shards,
            timeout=o.timeout if timeout is None else timeout,
        )
        return ColocatedFunction(self._fn, self._code, options)

    def on(self, hosts: Host | Sequence[Host]) -> HostCaller:
        """Calls with plain values on the given host (returns its value) or hosts (a list)."""
        return HostCaller(self, hosts)

    # --- array calls -----------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.submit(*args, **kwargs).result()

    def submit(self, *args: Any, **kwargs: Any) -> ArrayCallFuture:
        """Starts the call on every host and returns a future of the global result."""
        return ArrayCallFuture(self, args, kwargs)

    def _call(self, host: Host, args: tuple, kwargs: dict) -> Call:
        return Call.build(
            host.connection,
            pb.CallRequest.FUNCTION,
            args,
            kwargs,
            code=self._code,
            processes=self._options.processes,
            timeout=self._options.timeout,
        )

    def __repr__(self) -> str:
        return f"<colocated {self._code.name}>"


class HostCaller:
    """`f.on(hosts)`: plain-value calls on explicit hosts."""

    def __init__(self, fn: ColocatedFunction, hosts: Host | Sequence[Host]):
        self._fn = fn
        self._single = isinstance(hosts, Host)
        self._hosts = [hosts] if isinstance(hosts, Host) else list(hosts)
        if not self._hosts:
            raise ValueError("on() needs at least one host")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if inspect.isgeneratorfunction(self._fn._fn):
            streams = [self._stream(h, args, kwargs) for h in self._hosts]
            return streams[0] if self._single else streams
        if self._single:
            return self._fn._call(self._hosts[0], args, kwargs).run()
        return [f.result() for f in self.submit(*args, **kwargs)]

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        """Futures of the calls: one, or a list for a list of hosts."""
        futures = [self._fn._call(h, args, kwargs).start() for h in self._hosts]
        return futures[0] if self._single else futures

    def _stream(self, host: Host, args: tuple, kwargs: dict) -> RemoteIterator:
        call = self._fn._call(host, args, kwargs)
        return RemoteIterator(host.connection, call.request, self._fn._code, self._fn._options.prefetch)


class ArrayCallFuture:
    """A colocated call with array semantics in flight on all its hosts."""

    def __init__(self, fn: ColocatedFunction, args: tuple, kwargs: dict):
        self._fn = fn
        options = fn._options
        name = fn._code.name
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        leaves = [arrays.key_data(leaf) for leaf in leaves]
        args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
        array_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
        self._in_arrays = [leaves[i] for i in array_positions]
        if self._in_arrays:
            devices = [d for x in self._in_arrays for d in x.sharding.device_set]
        elif options.devices is not None:
            devices = list(options.devices)
        else:
            raise ValueError(
                f"{name} has no jax.Array arguments: give it devices with "
                f"{fn.__name__}.specialize(devices=...), or call {fn.__name__}.on(hosts)(...)"
            )
        self._hosts = _hosts_for(devices)
        self._in_specs = jax.tree_util.tree_map(
            lambda x: (
                jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x
            ),
            (args, kwargs),
        )
        self._layouts: dict[int, list[arrays.HostLayout]] = {}
        self._futures: list[tuple[Host, CallFuture]] = []
        try:
            for host in self._hosts:
                self._futures.append((host, self._start(host, leaves, array_positions, treedef)))
        except BaseException:  # an interrupt, or a failure on a later host: none goes on
            self._give_up()
            raise

    def _start(self, host: Host, leaves: list[Any], array_positions: list[int], treedef: Any) -> CallFuture:
        """Stages the host's blocks of the array arguments and starts the host's call."""
        name = self._fn._code.name
        host_leaves = list(leaves)
        layouts = []
        if self._fn._options.per_device_shards:
            for i in array_positions:
                host_leaves[i] = arrays.per_device(leaves[i], host.devices)
        else:
            for i in array_positions:
                x = leaves[i]
                layout = arrays.host_layout(x.sharding, x.shape, host.devices, f"argument of {name}")
                if layout is None:
                    raise ArrayLayoutError(
                        f"{name}: an array argument has no shard on {host.name}, while another "
                        "has; place all array arguments on the same devices"
                    )
                layouts.append(layout)
            blocks = self._stage(host, [leaves[i] for i in array_positions], layouts)
            for i, block in zip(array_positions, blocks, strict=True):
                host_leaves[i] = block
        self._layouts[host.index] = layouts
        host_args, host_kwargs = jax.tree_util.tree_unflatten(treedef, host_leaves)
        return self._fn._call(host, host_args, host_kwargs).start()

    @staticmethod
    def _stage(host: Host, xs: list[jax.Array], layouts: list[arrays.HostLayout]) -> list[np.ndarray]:
        """Each input's host block, built straight in the sidecar's arena when it is mapped here."""
        specs = [(layout.shape, np.dtype(x.dtype)) for x, layout in zip(xs, layouts, strict=True)]
        # Object-like dtypes (StringDType) cannot live in the arena: ordinary memory, pickled.
        in_arena = [i for i, (_, dtype) in enumerate(specs) if host.connection.shm and holds(dtype)]
        staged = iter(host.connection.empty([specs[i] for i in in_arena]) if in_arena else [])
        blocks = [next(staged) if i in in_arena else np.empty(*spec) for i, spec in enumerate(specs)]
        for x, layout, block in zip(xs, layouts, blocks, strict=True):
            arrays.gather(x, layout, block)
        return blocks

    def _give_up(self) -> None:
        """After an interrupt: the call is given up on every host (see `CallFuture.give_up`)."""
        for _, future in self._futures:
            future.give_up()

    def result(self) -> Any:
        """The global result; an interrupt while waiting cancels the call on every host."""
        errors = []
        results = []
        for host, future in self._futures:
            try:
                results.append((host, future.result()))
            except Exception as e:  # noqa: BLE001 - the first error is raised after all finished
                errors.append(e)
            except BaseException:
                self._give_up()
                raise
        if errors:
            raise errors[0]
        if self._fn._options.per_device_shards:
            return [value for _, value in results]
        return self._assemble(results)

    def _assemble(self, results: list[tuple[Host, Any]]) -> Any:
        fn = self._fn
        name = fn._code.name
        trees = [jax.tree_util.tree_flatten(r, is_leaf=lambda x: x is None) for _, r in results]
        treedef = trees[0][1]
        if any(t[1] != treedef for t in trees):  # type: ignore[operator]
            raise ColocarError(f"{name} returned differently structured results on different hosts")
        n = len(trees[0][0])
        if fn._options.out_specs_fn is not None:
            specs_args, specs_kwargs = self._in_specs
            out_specs = fn._options.out_specs_fn(*specs_args, **specs_kwargs)
            spec_leaves = jax.tree_util.tree_leaves(out_specs)
            if len(spec_leaves) != n:
                raise ColocarError(f"{name}: out_specs_fn gave {len(spec_leaves)} outputs, the function {n}")
        else:
            spec_leaves = [None] * n
        out = []
        for k in range(n):
            values = [t[0][k] for t in trees]
            spec = spec_leaves[k]
            if isinstance(values[0], np.ndarray | np.generic) or spec is not None:  # 0-d: a scalar
                out.append(self._global(values, results, spec, f"output {k} of {name}"))
            elif all(_equal(v, values[0]) for v in values):
                out.append(values[0])
            else:
                raise ColocarError(
                    f"{name}: output {k} is a non-array value that differs between hosts; return "
                    f"arrays, or call {fn.__name__}.on(hosts) to get one value per host"
                )
        return jax.tree_util.tree_unflatten(treedef, out)

    def _global(self, values: list[Any], results: list[tuple[Host, Any]], spec: Any, what: str) -> jax.Array:
        blocks = {h.index: (h.devices, np.asarray(v)) for (h, _), v in zip(results, values, strict=True)}
        if spec is not None:
            return arrays.assemble(spec.shape, spec.dtype, spec.sharding, blocks, what)
        if not self._in_arrays:
            raise ColocarError(
                f"{what}: without array inputs, give out_specs_fn to say how outputs are sharded"
            )
        first = self._in_arrays[0]
        host0 = results[0][0]
        in_box = self._layouts[host0.index][0].shape if self._layouts[host0.index] else first.shape
        shape = arrays.infer_output_shape(first.shape, in_box, np.asarray(values[0]).shape, what)
        return arrays.assemble(shape, np.asarray(values[0]).dtype, first.sharding, blocks, what)


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return a is b


def colocated(
    fn: Callable[..., Any] | None = None,
    *,
    processes: bool = False,
    ship_modules: Sequence[Any] = (),
    timeout: float | None = None,
    prefetch: int = 2,
) -> Any:
    """Decorator: run `fn` on the sidecars (see the module docstring).

    processes: run in one of the sidecar's worker processes (CPU-bound code: no GIL contention
        with other calls). ship_modules: modules pickled by value (code the sidecar cannot
        import). timeout: seconds per call (CallTimeoutError after). prefetch: items in flight
        for generator functions.
    """

    def wrap(f: Callable[..., Any]) -> ColocatedFunction:
        options = Options(processes=processes, timeout=timeout, prefetch=prefetch)
        return ColocatedFunction(f, ShippedCode(f, tuple(ship_modules)), options)

    return wrap(fn) if fn is not None else wrap
