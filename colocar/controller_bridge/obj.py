"""`colocated_class`: objects that live in a sidecar (runs in the controller).

`Cls.on(host)(*args)` creates the object on that host and returns a handle; method calls run
there in program order. Dropping the handle deletes the remote object; so does the end of the
session. `Cls.on(host, name=..., ttl=...)` creates a detached object instead, owned by the
sidecar for `ttl` seconds whatever happens to this controller, and found again with
`host.object(name)`. `Cls(*args)` without a host mirrors `colocated_python_class`: an
instance is created, once per host, on the hosts of the first method call's arrays.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

from colocar.errors import HostLostError
from colocar.protocol import colocar_pb2 as pb

from .calls import Call, CallFuture, RemoteIterator, ShippedCode
from .cluster import Host
from .func import ArrayCallFuture, Options


class RemoteObject:
    """Handle on an object in a sidecar; attribute access gives its remote methods."""

    def __init__(self, host: Host, object_id: int, class_name: str, detached_name: str = ""):
        self._host = host
        self._object_id = object_id
        self._class_name = class_name
        self._detached_name = detached_name
        self._generation = host.connection.generation
        if not detached_name:
            weakref.finalize(self, host.connection.delete_object_soon, object_id, self._generation)

    def __getattr__(self, method: str) -> RemoteMethod:
        if method.startswith("__"):
            raise AttributeError(method)
        return RemoteMethod(self, method)

    def _check(self) -> None:
        if self._host.connection.generation != self._generation:
            raise HostLostError(
                f"remote {self._class_name} on {self._host.name} is gone: the sidecar restarted "
                "or the session expired since it was created"
            )

    def delete(self) -> None:
        """Deletes the remote object now (detached objects too)."""
        conn = self._host.connection
        conn.unary(
            "DeleteObject",
            pb.ObjectRef(
                session_id=conn.session_id, object_id=self._object_id, object_name=self._detached_name
            ),
            timeout=30,
        )

    def __repr__(self) -> str:
        return f"<remote {self._class_name} #{self._object_id} on {self._host.name}>"


class RemoteMethod:
    def __init__(self, obj: RemoteObject, method: str):
        self._obj = obj
        self._method = method

    def _build(self, args: tuple, kwargs: dict) -> Call:
        obj = self._obj
        obj._check()
        return Call.build(
            obj._host.connection,
            pb.CallRequest.METHOD,
            args,
            kwargs,
            object_id=obj._object_id,
            method=self._method,
            name=f"{obj._class_name}.{self._method}",
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._build(args, kwargs).run()

    def submit(self, *args: Any, **kwargs: Any) -> CallFuture:
        return self._build(args, kwargs).start()

    def stream(self, *args: Any, prefetch: int = 2, **kwargs: Any) -> RemoteIterator:
        """Iterates over what the method returns (a generator), at most `prefetch` items ahead."""
        call = self._build(args, kwargs)
        return RemoteIterator(call.conn, call.request, None, prefetch)


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

        def construct(*args: Any, **kwargs: Any) -> RemoteObject:
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
            return RemoteObject(host, call.run(), self._cls.__qualname__, name)

        return construct

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
        self._objects: dict[int, RemoteObject] = {}
        self._lock = threading.Lock()

    def _on(self, host: Host) -> RemoteObject:
        with self._lock:
            obj = self._objects.get(host.index)
            if obj is None or obj._generation != host.connection.generation:
                obj = self._objects[host.index] = self._cls.on(host)(*self._args, **self._kwargs)
            return obj

    def __getattr__(self, method: str) -> ColocatedMethod:
        if method.startswith("_"):
            raise AttributeError(method)
        return ColocatedMethod(self, method, Options())


class ColocatedMethod:
    """A method of a lazy remote object, with the array semantics of `@colocated` functions."""

    def __init__(self, owner: LazyRemoteObject, method: str, options: Options):
        self._owner = owner
        self._method = method
        self._options = options
        self.__name__ = method
        self._code = SimpleNamespace(name=f"{owner._cls.__qualname__}.{method}")

    def specialize(self, out_specs_fn: Any = None, devices: Any = None) -> ColocatedMethod:
        options = replace(
            self._options,
            out_specs_fn=out_specs_fn or self._options.out_specs_fn,
            devices=tuple(devices) if devices is not None else self._options.devices,
        )
        return ColocatedMethod(self._owner, self._method, options)

    def _call(self, host: Host, args: tuple, kwargs: dict) -> Call:
        return getattr(self._owner._on(host), self._method)._build(args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return ArrayCallFuture(self, args, kwargs).result()  # type: ignore[arg-type]

    def submit(self, *args: Any, **kwargs: Any) -> ArrayCallFuture:
        return ArrayCallFuture(self, args, kwargs)  # type: ignore[arg-type]


def colocated_class(cls: type | None = None, *, ship_modules: Sequence[Any] = ()) -> Any:
    """Class decorator: instances are created in a sidecar with `Cls.on(host)(...)`."""
    if cls is None:
        return lambda c: ColocatedClass(c, ship_modules)
    return ColocatedClass(cls, ship_modules)


def find_detached(host: Host, name: str) -> RemoteObject:
    """A handle on a detached object created earlier (by any controller) on `host`."""
    conn = host.connection
    found = conn.unary("FindObject", pb.ObjectRef(session_id=conn.session_id, object_name=name), timeout=30)
    return RemoteObject(host, found.object_id, name, detached_name=name)
