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

Callers use the parts themselves (`conn.session.generation`, `conn.blocks.empty(...)`,
`conn.releases.release_soon(...)`); this class only wires them together, translates a failed
unary call into the error a user sees, and closes them in order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import grpc

from colocar.protocol import colocar_pb2 as pb
from colocar.protocol.status import TransportError

from .arena_client import ArenaClient, run_stream
from .lanes import Lanes
from .link_client import LinkClient
from .logs import LogForwarder
from .releases import Releases
from .session import UNNAMED, Session, SessionName
from .transport import GrpcTransport, LinkTransport, grpc_failure, translate


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
        named: SessionName = UNNAMED,
    ):
        self._token = token or ""
        self._options: dict[str, Any] = dict(  # for `replacement`
            shm=shm,
            lease_seconds=lease_seconds,
            heartbeat_seconds=heartbeat_seconds,
            connect_timeout=connect_timeout,
            alloc_timeout=alloc_timeout,
            credentials=credentials,
            named=named,
        )
        self.grpc = GrpcTransport(address, self._token, heartbeat_seconds, credentials, self._discard_reply)
        self.transport = LinkTransport(self.grpc, name, self._discard_reply)
        self.session = Session(
            address,
            name,
            self.transport,
            self.grpc,
            self._connected,
            lease_seconds=lease_seconds,
            heartbeat_seconds=heartbeat_seconds,
            process_status=process_status,
            named=named,
            mapping=self._arena_mapping,
        )
        self.releases = Releases(name, self.session, self.transport)
        self.lanes = Lanes(self._discard_reply)
        session, grpc_ = self.session, self.grpc
        stream = functools.partial(
            run_stream, grpc_.stub, grpc_.metadata, session.check_alive, self.translate
        )
        self.blocks = ArenaClient(
            session.session_id,
            shm,
            alloc_timeout,
            self.unary,
            stream,
            release_soon=self.releases.release_soon,
        )
        self._open(connect_timeout)

    def _open(self, connect_timeout: float) -> None:
        """Connects, then starts the log forwarder and the heartbeat."""
        try:
            self.session.connect(connect_timeout)
        except BaseException:  # refused (token, version skew) or unreachable: leave nothing behind
            self.releases.close()
            self.transport.close()
            self.grpc.close()
            raise
        self.logs = LogForwarder(self.session, self.transport)
        self.session.start()

    def replacement(
        self,
        address: str,
        process_status: Callable[[], str | None] | None = None,
        connect_timeout: float | None = None,
    ) -> HostConnection:
        """A connection under this one's name, token and options to the sidecar on `address`
        (a host's replacement, see `Cluster.replace_host`): a new session there."""
        options = dict(self._options)
        if connect_timeout is not None:
            options["connect_timeout"] = connect_timeout
        name, token = self.session.name, self._token
        return HostConnection(address, name, token, process_status=process_status, **options)

    # --- connect: the arena and the local link ---------------------------------------------
    def _connected(self, reply: pb.ConnectReply) -> None:
        """After each (re)connect: maps the sidecar's arena if reachable, then opens the link."""
        self.blocks.attach(reply)
        link = None
        session = self.session
        if self.blocks.mapped and reply.link_path:
            try:
                link = LinkClient(
                    reply.link_path, self._token, lambda: session.unresponsive, session.heartbeat_seconds
                )
            except (OSError, TransportError):
                link = None  # not reachable from here: every call goes through gRPC
        self.transport.attach(link)

    def _arena_mapping(self) -> int:
        """Where this process maps the sidecar's arena (0: it does not): the sidecar keeps the
        blocks of an ended session while that mapping lives (arrays may alias them)."""
        arena = self.blocks.arena
        return arena.base_address if arena is not None else 0

    def _discard_reply(self, reply: Any) -> None:
        """Frees what a late reply of an abandoned call carries (the transports call this)."""
        self.releases.discard_reply(reply)

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

    # --- shutdown --------------------------------------------------------------------------
    def close(self) -> None:
        if self.session.closed:
            return
        self.releases.flush(timeout=5)
        self.session.close()
        self.releases.close()
        self.transport.close()
        self.grpc.close()
        self.blocks.detach()  # arrays over the arena keep their mapping; the sidecar sees it go
        self.logs.join(timeout=5)
