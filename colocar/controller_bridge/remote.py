"""Handles on objects living in a sidecar, and their methods (runs in the controller).

A `RemoteObject` is a handle: attribute access gives its remote methods, which run on its
host in program order. Dropping the handle deletes the remote object (not a detached one,
which the sidecar owns for its ttl; `find_detached` finds it again). Objects are created by
`colocated_class` (`obj.py`); this module needs no class, so `Host.object` can use it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from colocar.errors import HostLostError, ObjectNotFoundError
from colocar.protocol import colocar_pb2 as pb
from colocar.protocol.status import Status, TransportError

from .calls import Call, CallFuture
from .remote_iterator import RemoteIterator

if TYPE_CHECKING:
    from .connection import HostConnection


class Host(Protocol):
    """What a remote object needs of its host (`cluster.Host` is one): its name and connection.

    A protocol, not the class, so that this module does not import `cluster` (which imports it).
    """

    @property
    def name(self) -> str: ...

    @property
    def connection(self) -> HostConnection: ...


@dataclass(frozen=True)
class ObjectAddress:
    """Where a remote object lives: its host, its id there, and the sidecar's life it was made in."""

    host: Host
    object_id: int
    class_name: str
    detached_name: str = ""
    generation: int = 0

    @classmethod
    def current(cls, host: Host, object_id: int, class_name: str, detached_name: str = "") -> ObjectAddress:
        """An object the host has now (in its sidecar's current life)."""
        return cls(host, object_id, class_name, detached_name, host.connection.session.generation)

    @property
    def alive(self) -> bool:
        """False once the sidecar restarted or the session expired (the object is gone)."""
        return self.host.connection.session.generation == self.generation

    def check(self) -> None:
        if not self.alive:
            raise HostLostError(
                f"remote {self.class_name} on {self.host.name} is gone: the sidecar restarted "
                "or the session expired since it was created"
            )

    def call(self, method: str, args: tuple, kwargs: dict) -> Call:
        """A call of one of the object's methods."""
        self.check()
        return Call.build(
            self.host.connection,
            pb.CallRequest.METHOD,
            args,
            kwargs,
            object_id=self.object_id,
            method=method,
            name=f"{self.class_name}.{method}",
        )


class RemoteObject:
    """Handle on an object in a sidecar; attribute access gives its remote methods."""

    def __init__(self, address: ObjectAddress):
        self._address = address
        if not address.detached_name:
            conn = address.host.connection
            weakref.finalize(self, conn.releases.delete_object_soon, address.object_id, address.generation)

    def __getattr__(self, method: str) -> RemoteMethod:
        if method.startswith("__"):
            raise AttributeError(method)
        return RemoteMethod(self, self._address, method)

    def delete(self) -> None:
        """Deletes the remote object now (detached objects too)."""
        address = self._address
        conn = address.host.connection
        conn.unary(
            "DeleteObject",
            pb.ObjectRef(
                session_id=conn.session.session_id,
                object_id=address.object_id,
                object_name=address.detached_name,
            ),
            timeout=30,
        )

    def __repr__(self) -> str:
        address = self._address
        return f"<remote {address.class_name} #{address.object_id} on {address.host.name}>"


class RemoteMethod:
    """A method of a remote object: a call, a future (`submit`) or a stream of its items."""

    def __init__(self, handle: RemoteObject, address: ObjectAddress, method: str):
        self._handle = handle  # the object lives at least as long as its method is in hand
        self._address = address
        self._method = method

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._address.call(self._method, args, kwargs).run()

    def submit(self, *args: Any, **kwargs: Any) -> CallFuture:
        return self._address.call(self._method, args, kwargs).start()

    def stream(self, *args: Any, prefetch: int = 2, **kwargs: Any) -> RemoteIterator:
        """Iterates over what the method returns (a generator), at most `prefetch` items ahead."""
        call = self._address.call(self._method, args, kwargs)
        return RemoteIterator(call.conn, call.request, None, prefetch)


def find_detached(host: Host, name: str) -> RemoteObject:
    """A handle on a named object created earlier on `host`: this session's (by this controller,
    or by the one whose named session it took over), else a detached one (by any controller).
    Raises `ObjectNotFoundError` when there is none."""
    conn = host.connection
    request = pb.ObjectRef(session_id=conn.session.session_id, object_name=name)
    conn.session.check_alive()
    try:
        found = conn.transport.call("FindObject", request, 30)
    except TransportError as e:
        if e.status == Status.NOT_FOUND:
            raise ObjectNotFoundError(f"{host.name}: {e.details.removeprefix('object: ')}") from None
        raise conn.translate(e, "FindObject") from None
    return RemoteObject(ObjectAddress.current(host, found.object_id, name, detached_name=name))
