"""`@colocated`: ship a Python function to the sidecars (runs in the controller).

Two ways to call, mirroring `jax.experimental.colocated_python` where it has an equivalent:

* `f(x, ...)` with `jax.Array` arguments runs `f` on every host that holds part of them; each
  host gets its block of each array as one numpy array (see `arrays.py`), and array results
  come back as global `jax.Array`s, sharded by `out_specs_fn` or by the default rule (the first
  array input's sharding, each host returning its block). Without array arguments, `devices`
  must be given with `specialize`. Planning and staging are `planner.py`'s and
  `array_calls.py`'s, shared with the methods of `colocated_class`.
* `f.on(hosts)(...)` runs `f` on the given host(s) with plain Python values and returns plain
  values (one per host for a list of hosts). Generator functions stream their items.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from colocar.protocol import colocar_pb2 as pb

from .array_calls import ArrayCallFuture, ArrayTarget, CallBuilder
from .calls import Call, ShippedCode
from .cluster import Host, check_reachable
from .remote_iterator import RemoteIterator
from .specs import Options

__all__ = ["ColocatedFunction", "HostCaller", "Options", "colocated"]


class ColocatedFunction:
    """A function that runs on the sidecars; see the module docstring."""

    def __init__(self, fn: Callable[..., Any], code: ShippedCode, options: Options):
        self._fn = fn
        self._code = code
        self._options = options
        functools.update_wrapper(self, fn)
        self.__name__: str = getattr(fn, "__name__", "function")
        self._target = ArrayTarget(code.name, self.__name__, options, self._bind)

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
        """A copy with input or output specs, devices (for calls without array inputs) or
        other options. As in JAX, in_specs, out_specs_fn and devices are each given once, and
        calls must match the in_specs given."""
        options = self._options.specialize(
            in_specs, out_specs_fn, devices, per_device_shards=per_device_shards, timeout=timeout
        )
        return ColocatedFunction(self._fn, self._code, options)

    def on(self, hosts: Host | Sequence[Host]) -> HostCaller:
        """Calls with plain values on the given host (returns its value) or hosts (a list)."""
        stream = inspect.isgeneratorfunction(self._fn)
        return HostCaller(self._build, self._code if stream else None, self._options.prefetch, hosts)

    # --- array calls -----------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.submit(*args, **kwargs).result()

    def submit(self, *args: Any, **kwargs: Any) -> ArrayCallFuture:
        """Starts the call on every host and returns a future of the global result."""
        return ArrayCallFuture(self._target, args, kwargs)

    def _build(self, host: Host, args: tuple, kwargs: dict) -> Call:
        return Call.build(
            host.connection,
            pb.CallRequest.FUNCTION,
            args,
            kwargs,
            code=self._code,
            processes=self._options.processes,
            timeout=self._options.timeout,
        )

    def _bind(self, host: Host) -> CallBuilder:
        return functools.partial(self._build, host)

    def __repr__(self) -> str:
        return f"<colocated {self._code.name}>"


class HostCaller:
    """`f.on(hosts)`: plain-value calls on explicit hosts."""

    def __init__(
        self,
        build: Callable[[Host, tuple, dict], Call],
        stream_code: ShippedCode | None,
        prefetch: int,
        hosts: Host | Sequence[Host],
    ):
        self._build = build  # a host's call
        self._stream_code = stream_code  # a generator function's code: calls stream its items
        self._prefetch = prefetch
        self._single = isinstance(hosts, Host)
        self._hosts = [hosts] if isinstance(hosts, Host) else list(hosts)
        if not self._hosts:
            raise ValueError("on() needs at least one host")
        for host in self._hosts:
            check_reachable(host)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._stream_code is not None:
            streams = [self._stream(h, args, kwargs) for h in self._hosts]
            return streams[0] if self._single else streams
        if self._single:
            return self._build(self._hosts[0], args, kwargs).run()
        futures = self.submit(*args, **kwargs)
        try:
            return [f.result() for f in futures]
        except BaseException as e:
            if not isinstance(e, Exception):  # an interrupt: every host's call is given up
                for future in futures:
                    future.cancel()
            raise

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        """Futures of the calls: one, or a list for a list of hosts."""
        futures = [self._build(h, args, kwargs).start() for h in self._hosts]
        return futures[0] if self._single else futures

    def _stream(self, host: Host, args: tuple, kwargs: dict) -> RemoteIterator:
        call = self._build(host, args, kwargs)
        return RemoteIterator(host.connection, call.request, self._stream_code, self._prefetch)


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
