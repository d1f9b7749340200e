"""`colocated_class`: objects that live in a sidecar (runs in the controller).

`Cls.on(host)(*args)` creates the object on that host and returns a handle (`remote.py`);
method calls run there in program order. Dropping the handle deletes the remote object; so
does the end of the session. `Cls.on(host, name=..., ttl=...)` creates a detached object
instead, owned by the sidecar for `ttl` seconds whatever happens to this controller, and found
again with `host.object(name)`. `Cls(*args)` without a host mirrors `colocated_python_class`:
an instance is created, once per host, on the hosts of the first method call's arrays.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from colocar.protocol import colocar_pb2 as pb

from .array_calls import ArrayCallFuture, ArrayTarget, CallBuilder
from .calls import Call, ShippedCode
from .cluster import Host, check_reachable
from .remote import ObjectAddress, RemoteObject
from .specs import Options

__all__ = ["ColocatedClass", "ColocatedMethod", "LazyRemoteObject", "RemoteObject", "colocated_class"]


class ColocatedClass:
    """A class whose instances live in sidecars."""

    def __init__(self, cls: type, ship_modules: Sequence[Any] = ()):
        self._cls = cls
        self._code = ShippedCode(cls, tuple(ship_modules))
        self.__name__ = cls.__name__
        self.__qualname__ = cls.__qualname__
        self.__doc__ = cls.__doc__

    def on(self, host: Host, *, name: str = "", ttl: float = 0.0) -> Any:
        """A constructor that creates the object on `host` (detached if `name` is given)."""
        check_reachable(host)

        def construct(*args: Any, **kwargs: Any) -> RemoteObject:
            return RemoteObject(self.create(host, args, kwargs, name=name, ttl=ttl))

        return construct

    def create(
        self, host: Host, args: tuple, kwargs: dict, *, name: str = "", ttl: float = 0.0
    ) -> ObjectAddress:
        """Creates an instance on `host` (detached if `name` is given); returns where it lives.
        Without a `RemoteObject` handle on it, nothing deletes it before the session ends."""
        call = Call.build(
            host.connection,
            pb.CallRequest.NEW_OBJECT,
            args,
            kwargs,
            code=self._code,
            name=self._code.name,
            object_name=name,
            object_ttl=ttl,
        )
        return ObjectAddress.current(host, call.run(), self._cls.__qualname__, name)

    def __call__(self, *args: Any, **kwargs: Any) -> LazyRemoteObject:
        """Like `jax.experimental.colocated_python_class`: one instance per host, created on
        the hosts of the first method call's array arguments."""
        return LazyRemoteObject(self, args, kwargs)

    def __repr__(self) -> str:
        return f"<colocated class {self._code.name}>"


class LazyRemoteObject:
    """Instances created on demand on the hosts that a method call's arrays live on."""

    def __init__(self, cls: ColocatedClass, args: tuple, kwargs: dict):
        self._cls = cls
        self._args = args
        self._kwargs = kwargs
        # by sidecar address: a cluster over some hosts numbers them anew (`elastic`)
        self._objects: dict[str, tuple[RemoteObject, ObjectAddress]] = {}
        self._lock = threading.Lock()

    def _on(self, host: Host) -> ObjectAddress:
        """The instance on `host`, created now if it has none (or lost it)."""
        with self._lock:
            held = self._objects.get(host.address)
            if held is None or not held[1].alive:
                address = self._cls.create(host, self._args, self._kwargs)
                held = self._objects[host.address] = (RemoteObject(address), address)
            return held[1]

    def __getattr__(self, method: str) -> ColocatedMethod:
        if method.startswith("_"):
            raise AttributeError(method)
        return ColocatedMethod(self._on, f"{self._cls.__qualname__}.{method}", method, Options())


class ColocatedMethod:
    """A method of a lazy remote object, with the array semantics of `@colocated` functions."""

    def __init__(self, locate: Callable[[Host], ObjectAddress], name: str, method: str, options: Options):
        self._locate = locate  # the instance on a host (created there on first use)
        self._method = method
        self.__name__ = method
        self._target = ArrayTarget(name, method, options, self._bind)

    def specialize(
        self, in_specs: Any = None, out_specs_fn: Any = None, devices: Any = None
    ) -> ColocatedMethod:
        """A copy with input specs, output specs or devices, each given once (as in JAX)."""
        options = self._target.options.specialize(in_specs, out_specs_fn, devices)
        return ColocatedMethod(self._locate, self._target.name, self._method, options)

    def _bind(self, host: Host) -> CallBuilder:
        address = self._locate(host)

        def build(args: tuple, kwargs: dict) -> Call:
            return address.call(self._method, args, kwargs)

        return build

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return ArrayCallFuture(self._target, args, kwargs).result()

    def submit(self, *args: Any, **kwargs: Any) -> ArrayCallFuture:
        return ArrayCallFuture(self._target, args, kwargs)


def colocated_class(cls: type | None = None, *, ship_modules: Sequence[Any] = ()) -> Any:
    """Class decorator: instances are created in a sidecar with `Cls.on(host)(...)`."""
    if cls is None:
        return lambda c: ColocatedClass(c, ship_modules)
    return ColocatedClass(cls, ship_modules)
