"""The controller's link to one sidecar: a thin composition of parts with one job each.

Runs in the controller (device owner). One `HostConnection` per sidecar holds:
- the session (`session.py`: connect, keepalive, lost, generation),
- the transport of unary calls (`transport.py`: the local link when the controller is on the
  sidecar's host, else gRPC) and the ordering lanes on top of it (`lanes.py`),
- the background releases, deletes and cancels (`releases.py`),
- the log forwarder (`logs.py`),
- and the block transport: the sidecar's arena mapped here when it is reachable (same host,
  same shm dir; detected by attaching and checking the arena's nonce), else chunked gRPC
  streams.

Its other attributes and methods delegate to these parts (so that callers keep working while
they move to the parts themselves).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import grpc
import numpy as np

from colocar.errors import HostLostError
from colocar.protocol import colocar_pb2 as pb
from colocar.protocol.status import TransportError
from colocar.shm import Arena

from .arena_client import ArenaClient, run_stream
from .lanes import LaneFuture, Lanes, Send
from .link_client import LinkClient
from .logs import LogForwarder
from .releases import Releases
from .session import Session
from .transport import GrpcTransport, LinkTransport, Unsent, grpc_failure, translate


class HostConnection:
    """A session with one sidecar, and the transport of calls and arrays to it."""

    def __init__(
        self,
        address: str,
        name: str,
        token: str | None,
        *,
        shm: bool = True,
        lease_seconds: float = 30.0,
        heartbeat_seconds: float = 1.0,
        connect_timeout: float = 30.0,
        alloc_timeout: float = 30.0,
        credentials: grpc.ChannelCredentials | None = None,
        process_status: Callable[[], str | None] | None = None,
    ):
        self._token = token or ""
        self.grpc = GrpcTransport(address, self._token, heartbeat_seconds, credentials, self.discard_reply)
        self.transport = LinkTransport(self.grpc, name, self.discard_reply)
        self.session = Session(
            address,
            name,
            self.transport,
            self.grpc,
            self._connected,
            lease_seconds=lease_seconds,
            heartbeat_seconds=heartbeat_seconds,
            process_status=process_status,
        )
        self.releases = Releases(name, self.session, self.transport)
        self.lanes = Lanes(self.discard_reply)
        grpc_ = self.grpc
        stream = functools.partial(run_stream, grpc_.stub, grpc_.metadata, self.check_alive, self.translate)
        self.arenas = ArenaClient(
            self.session.session_id, shm, alloc_timeout, self.unary, stream, release_soon=self.release_soon
        )
        try:
            self.session.connect(connect_timeout)
        except BaseException:  # refused (token, version skew) or unreachable: leave nothing behind
            self.releases.close()
            self.transport.close()
            self.grpc.close()
            raise
        self.logs = LogForwarder(self.session, self.transport)
        self.session.start()

    # --- connect: the arena and the local link ---------------------------------------------
    def _connected(self, reply: pb.ConnectReply) -> None:
        """After each (re)connect: maps the sidecar's arena if reachable, then opens the link."""
        self.arenas.attach(reply)
        link = None
        if self.arena is not None and reply.link_path:
            try:
                link = LinkClient(
                    reply.link_path, self._token, lambda: self.session.unresponsive, self.heartbeat_seconds
                )
            except (OSError, TransportError):
                link = None  # not reachable from here: every call goes through gRPC
        self.transport.attach(link)

    # --- calls -----------------------------------------------------------------------------
    def translate(self, e: TransportError | grpc.RpcError, what: str) -> Exception:
        """A failed call (either transport, or a gRPC stream) as the error a user should see."""
        failure = grpc_failure(e) if isinstance(e, grpc.RpcError) else e
        return translate(failure, what, self.session)

    def unary(self, method: str, request: Any, timeout: float | None = None) -> Any:
        self.session.check_alive()
        try:
            return self.transport.call(method, request, timeout)
        except TransportError as e:
            raise self.translate(e, method) from None

    def stats(self) -> pb.StatsReply:
        return self.unary("Stats", pb.Empty(), timeout=10)

    # --- arrays (the arena client's) --------------------------------------------------------
    @property
    def arena(self) -> Arena | None:
        return self.arenas.arena

    @property
    def shm(self) -> bool:
        return self.arenas.mapped

    @property
    def alloc_timeout(self) -> float:
        """Default wait (s) of an Allocate for room in the arena."""
        return self.arenas.alloc_timeout

    @alloc_timeout.setter
    def alloc_timeout(self, seconds: float) -> None:
        self.arenas.alloc_timeout = seconds

    def empty(
        self, specs: list[tuple[tuple[int, ...], np.dtype]], pool: str = "", timeout: float | None = None
    ) -> list[np.ndarray]:
        return self.arenas.empty(specs, pool, timeout)

    def allocate(self, sizes: list[int], pool: str = "", timeout: float | None = None) -> list[pb.BlockDesc]:
        return self.arenas.allocate(sizes, pool, timeout)

    def encode(self, value: Any, what: str) -> tuple[pb.Payload, list[int], list[np.ndarray]]:
        return self.arenas.encode(value, what)

    def decode(self, payload: pb.Payload) -> Any:
        return self.arenas.decode(payload)

    def upload(self, array: np.ndarray) -> pb.BlockDesc:
        return self.arenas.upload(array)

    def download(self, desc: pb.BlockDesc, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        return self.arenas.download(desc, shape, dtype)

    # --- delegations to the parts ------------------------------------------------------------
    @property
    def address(self) -> str:
        return self.session.address

    @property
    def name(self) -> str:
        return self.session.name

    @property
    def session_id(self) -> str:
        return self.session.session_id

    @property
    def lease_seconds(self) -> float:
        return self.session.lease_seconds

    @property
    def heartbeat_seconds(self) -> float:
        return self.session.heartbeat_seconds

    @property
    def generation(self) -> int:
        return self.session.generation

    @property
    def lost(self) -> HostLostError | None:
        return self.session.lost

    @property
    def unresponsive(self) -> bool:
        return self.session.unresponsive

    @property
    def info(self) -> pb.ConnectReply:
        return self.session.info

    @property
    def known_code(self) -> set[bytes]:
        return self.session.known_code

    @property
    def alive_at(self) -> float:
        return self.session.alive_at

    @alive_at.setter
    def alive_at(self, value: float) -> None:
        self.session.alive_at = value

    def heartbeat(self) -> None:
        self.session.heartbeat()

    def mark_lost(self, reason: str) -> None:
        self.session.mark_lost(reason)

    def check_alive(self) -> None:
        self.session.check_alive()

    @property
    def link(self) -> LinkClient | None:
        return self.transport.link

    @property
    def stub(self) -> Any:
        return self.grpc.stub

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return self.grpc.metadata

    @property
    def channel(self) -> grpc.Channel:
        return self.grpc.channel

    def sync(self, method: str, request: Any, timeout: float | None = None, unsent: Unsent = None) -> Any:
        return self.transport.call(method, request, timeout, unsent)

    def submit(self, send: Send, unsent: Callable[[], None] | None = None) -> LaneFuture:
        return self.lanes.submit(send, unsent)

    def lane_idle(self) -> bool:
        return self.lanes.idle()

    def discard_reply(self, reply: Any) -> None:
        self.releases.discard_reply(reply)

    def release_soon(self, block_ids: Iterable[int]) -> None:
        self.releases.release_soon(block_ids)

    def cancel_soon(self, call_id: int) -> None:
        self.releases.cancel_soon(call_id)

    def delete_object_soon(self, object_id: int, generation: int) -> None:
        self.releases.delete_object_soon(object_id, generation)

    def next_call_id(self) -> int:
        return self.session.next_call_id()

    # --- shutdown --------------------------------------------------------------------------
    def close(self) -> None:
        if self.session.closed:
            return
        self.releases.flush(timeout=5)
        self.session.close()
        self.releases.close()
        self.transport.close()
        self.grpc.close()
        self.logs.join(timeout=5)
