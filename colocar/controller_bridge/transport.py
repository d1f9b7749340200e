"""How unary RPCs reach one sidecar: gRPC, or the local link when the controller is on its host.

One interface (`call`, `call_async`) with two implementations. Both raise `TransportError`
(the sidecar's status or the transport's failure), and `translate` turns it into the error a
user sees, in one place. `LinkTransport` carries what the local link serves and hands the rest
(and everything while there is no link) to its `GrpcTransport`, which also keeps the streams.

A wait cut short (an interrupt, a timeout) leaves the reply to `discard` (which frees what it
carries); `unsent` runs if the call certainly never reached the sidecar.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import grpc

from colocar.errors import (
    AuthError,
    CallTimeoutError,
    ColocarError,
    HostLostError,
    ObjectNotFoundError,
    QuotaExceededError,
    SessionEndedError,
)
from colocar.protocol import colocar_pb2_grpc as pb_grpc
from colocar.protocol.link import MAX_FRAME, MAX_REQUEST
from colocar.protocol.link import METHODS as LINK_METHODS
from colocar.protocol.status import ARENA_QUOTA_REACHED, QUOTA_REACHED, Status, TransportError
from colocar.protocol.tokens import TOKEN_METADATA_KEY
from colocar.shm import ArenaFullError

from .lanes import Reader
from .link_client import LinkClient, LinkGone, PendingReply
from .link_pool import LinkPool, LinkReply
from .sigint import sigint_held

MiB = 1 << 20
LOST = (Status.UNAVAILABLE, Status.CANCELLED)
LINK_THREADS = 16  # replies read in the background at once over one host's local link
TOO_LARGE_HINT = (  # why a request can exceed MAX_REQUEST, and what to do
    "arguments travel through the arena, but what a function's closure or defaults capture "
    "travels inside its code: pass large values as arguments"
)

Done = Callable[[Any, BaseException | None], None]  # (reply, None) or (None, error)
Unsent = Callable[[], None] | None  # runs if the call certainly never reached the sidecar


def channel_options(heartbeat_seconds: float) -> list[tuple[str, Any]]:
    """gRPC keepalive pings detect a dead or stopped sidecar even in the middle of a call
    (calls waiting on the local link learn it from the heartbeat)."""
    ping_ms = max(200, int(heartbeat_seconds * 1000))
    return [
        ("grpc.max_receive_message_length", MAX_FRAME),
        ("grpc.max_send_message_length", MAX_REQUEST),
        ("grpc.keepalive_time_ms", ping_ms),
        ("grpc.keepalive_timeout_ms", 2 * ping_ms),
        # gRPC >= 1.57 waits for ping acks this long (default 1 min), whatever keepalive_timeout says
        ("grpc.http2.ping_timeout_ms", 2 * ping_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.enable_retries", 0),
        # Without calls for this long the channel drops its connection: an idle connected
        # channel keeps gRPC's event-engine threads waking (~1 ms of CPU per second per
        # channel). With a local link gRPC carries only streams (and, rarely, a reconnect), so
        # it is idle nearly always; without one, the log poll and heartbeats keep it open.
        ("grpc.client_idle_timeout_ms", max(1000, ping_ms)),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


class Transport(Protocol):
    def call(self, method: str, request: Any, timeout: float | None = None, unsent: Unsent = None) -> Any:
        """The reply of one unary call; raises TransportError."""
        ...

    def call_async(
        self, method: str, request: Any, timeout: float | None, done: Done, unsent: Unsent
    ) -> Reader | None:
        """Starts one unary call; `done(reply, error)` runs once it ends (the error a
        TransportError, or CancelledError). Raises, and arranges nothing, if it cannot start.
        A call whose reply is read on demand returns its `Reader` (`wait` or `detach` it)."""
        ...


def grpc_failure(e: grpc.RpcError) -> TransportError:
    """A gRPC error as the transports' error."""
    code = e.code()
    status = Status.of(code.value[0]) if isinstance(code, grpc.StatusCode) else Status.UNKNOWN
    return TransportError(status, e.details() or "")


class Peer(Protocol):
    name: str
    address: str

    ended: SessionEndedError | None
    closed: bool  # by this controller (`close()`)

    def mark_lost(self, reason: str) -> None: ...

    def mark_ended(self, reason: str) -> None: ...


class ArenaQuotaError(QuotaExceededError, ArenaFullError):
    """A tenant's arena quota is used up: a full arena to the code that waits for room."""


def translate(e: TransportError, what: str, peer: Peer) -> Exception:
    """A failed call as the error a user should see (a lost host is marked lost). A call cut
    off by this controller's own `close()` (in another thread) is no host loss: code that
    recovers from a HostLostError must not take a shutdown for one."""
    status, details, name = e.status, e.details, peer.name
    if peer.closed:
        return ColocarError(f"{what} on {name}: the connection to the sidecar was closed during the call")
    if status in LOST:
        peer.mark_lost(f"{what}: {details}")
        return HostLostError(f"sidecar {name} at {peer.address} is lost ({what}: {details})")
    if status == Status.DEADLINE_EXCEEDED:
        return CallTimeoutError(f"{what} on {name} timed out (it may still run there)")
    if status == Status.UNAUTHENTICATED:
        return AuthError(f"{what} on {name}: {details}")
    if status == Status.ABORTED:  # the session was taken over, or closed from elsewhere
        peer.mark_ended(details)
        return SessionEndedError(str(peer.ended) if peer.ended else f"{what} on {name}: {details}")
    if status == Status.FAILED_PRECONDITION and details.startswith("unknown session"):
        peer.mark_lost(details)
        return HostLostError(
            f"{what} on {name}: the sidecar lost this session (restart or expired "
            "lease); remote objects and arrays on it are gone"
        )
    if status == Status.NOT_FOUND and details.startswith("object: "):  # deleted, expired or never made
        return ObjectNotFoundError(f"{what} on {name}: {details.removeprefix('object: ')}")
    if status == Status.RESOURCE_EXHAUSTED and "message larger than max" in details:  # gRPC's limit
        return ColocarError(f"{what} on {name}: {details}; {TOO_LARGE_HINT}")
    if status == Status.RESOURCE_EXHAUSTED and QUOTA_REACHED in details:
        error = ArenaQuotaError if ARENA_QUOTA_REACHED in details else QuotaExceededError
        return error(f"{what} on {name}: {details}")
    if status == Status.RESOURCE_EXHAUSTED:
        return ArenaFullError(f"{what} on {name}: {details}")
    return ColocarError(f"{what} on {name} failed: {status.name}: {details}")


class GrpcTransport:
    """The gRPC channel to a sidecar: unary calls, streams, and the token on each."""

    def __init__(
        self,
        address: str,
        token: str,
        heartbeat_seconds: float,
        credentials: grpc.ChannelCredentials | None,
        discard: Callable[[Any], None],
    ):
        self.metadata = ((TOKEN_METADATA_KEY, token),)
        self._address, self._credentials = address, credentials
        self._options = channel_options(heartbeat_seconds)
        self.channel = self._channel()
        self.stub = pb_grpc.SidecarStub(self.channel)
        self._discard = discard

    def _channel(self) -> grpc.Channel:
        if self._credentials is not None:
            return grpc.secure_channel(self._address, self._credentials, options=self._options)
        return grpc.insecure_channel(self._address, options=self._options)

    def accepts_connections(self, timeout: float) -> bool:
        """Whether the sidecar's process completes a new HTTP/2 handshake within `timeout`.

        gRPC's core does that on its own threads, without Python's GIL: a sidecar busy in a
        long call that holds the GIL (its first tensorstore import: a second or more) still
        passes, one that is stopped, dead or cut off does not. A probe, not a call: it proves
        the process runs, not that its Python does."""
        channel = self._channel()
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            return False
        finally:
            channel.close()
        return True

    def call(self, method: str, request: Any, timeout: float | None = None, unsent: Unsent = None) -> Any:
        rpc = None
        try:
            with sigint_held():  # see sigint.py: an interrupt inside the set-up strands the call
                rpc = getattr(self.stub, method).future(request, metadata=self.metadata)
            return rpc.result(timeout)
        except grpc.FutureTimeoutError:
            assert rpc is not None
            rpc.add_done_callback(self._discard_rpc)
            raise TransportError(Status.DEADLINE_EXCEEDED, "deadline exceeded") from None
        except grpc.RpcError as e:
            raise grpc_failure(e) from None
        except BaseException:
            if rpc is not None:
                rpc.add_done_callback(self._discard_rpc)
            elif unsent is not None:
                unsent()
            raise

    def call_async(
        self, method: str, request: Any, timeout: float | None, done: Done, unsent: Unsent
    ) -> None:
        """The reply comes in gRPC's thread. Also raises a Ctrl-C that came while the call
        started, once `done` is arranged (as an interrupt just after this returned would)."""

        def finished(f: Any) -> None:
            try:
                reply = f.result()
            except grpc.RpcError as e:
                done(None, grpc_failure(e))
            except BaseException as e:  # cancelled
                done(None, e)
            else:
                done(reply, None)

        with sigint_held():  # see sigint.py
            rpc = getattr(self.stub, method).future(request, metadata=self.metadata, timeout=timeout)
            rpc.add_done_callback(finished)

    def connect(self, request: Any, timeout: float) -> Any:
        """Opens the session (waits for the sidecar to be reachable, up to `timeout`)."""
        try:
            return self.stub.Connect(request, metadata=self.metadata, timeout=timeout, wait_for_ready=True)
        except grpc.RpcError as e:
            raise grpc_failure(e) from None

    def stream(self, method: str, requests: Iterator[Any]) -> Any:
        """A streaming call's replies (a gRPC iterator; its errors are grpc.RpcError)."""
        with sigint_held():  # see sigint.py
            return getattr(self.stub, method)(requests, metadata=self.metadata)

    def _discard_rpc(self, rpc: Any) -> None:
        try:
            reply = rpc.result()
        except Exception:  # noqa: BLE001 - a failed call carries nothing
            return
        self._discard(reply)

    def close(self) -> None:
        self.channel.close()


def check_size(size: int, unsent: Unsent = None) -> None:
    """Raises, after `unsent`, for a request of `size` bytes over what a sidecar accepts
    (`MAX_REQUEST`): it is refused before it is sent."""
    if size <= MAX_REQUEST:
        return
    if unsent is not None:
        unsent()
    raise TransportError(
        Status.INVALID_ARGUMENT,
        f"the request is {size / MiB:.1f} MiB, over the {MAX_REQUEST // MiB} MiB a message to a "
        f"sidecar may carry; {TOO_LARGE_HINT}",
    )


class LinkTransport:
    """The local link, when there is one (`attach`), for the methods it serves; gRPC otherwise.

    A future's reply over the link is read by the thread that waits for it, or by the pool's
    threads (see `link_pool`); the pool lives as long as the transport, across the links of
    successive sessions."""

    def __init__(self, grpc_transport: GrpcTransport, name: str, discard: Callable[[Any], None]):
        self.grpc = grpc_transport
        self.link: LinkClient | None = None
        self._name = name
        self._discard = discard
        self._pool: LinkPool | None = None
        self._lock = threading.Lock()
        self._closed = False

    def attach(self, link: LinkClient | None) -> None:
        """Replaces the link (None: every call goes through gRPC) and retires the one before:
        its calls in flight finish there (or fail on their own), never on a closed socket."""
        old, self.link = self.link, link
        if old is not None:
            old.retire()

    def call(self, method: str, request: Any, timeout: float | None = None, unsent: Unsent = None) -> Any:
        pending = self._on_link(method, request, timeout, unsent)
        if pending is not None:
            return pending.wait()
        check_size(request.ByteSize(), unsent)
        return self.grpc.call(method, request, timeout, unsent)

    def call_async(
        self, method: str, request: Any, timeout: float | None, done: Done, unsent: Unsent
    ) -> Reader | None:
        """Over the local link the request is sent now, and its `LinkReply` returned; a
        failure to send goes to `done`, as a failed call does."""
        try:
            pending = self._on_link(method, request, timeout, unsent)
            if pending is None:
                check_size(request.ByteSize(), unsent)
        except TransportError as e:
            done(None, e)
            return None
        if pending is not None:
            return LinkReply(pending, done, self._threads)
        self.grpc.call_async(method, request, timeout, done, unsent)
        return None

    def _on_link(
        self, method: str, request: Any, timeout: float | None, unsent: Unsent
    ) -> PendingReply | None:
        """The call sent on the local link, when it serves `method`; else None: the call goes
        through gRPC. A link retired before the call sent anything (LinkGone) hands it to the
        link that replaced it; a closed one raises LinkGone, after `unsent`. A request too
        large is refused here, serialized once."""
        link, reply_type = self.link, LINK_METHODS.get(method, (None, None))[1]
        if link is None or reply_type is None:
            return None
        message = request.SerializeToString()
        check_size(len(message), unsent)
        while link is not None:
            try:
                return link.send(method, message, reply_type, timeout, self._discard, unsent)
            except LinkGone:
                if self.link is link:  # closed, not replaced
                    if unsent is not None:
                        unsent()
                    raise
                link = self.link
        return None

    def _threads(self) -> LinkPool:
        pool = self._pool
        if pool is not None:
            return pool
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if self._pool is None:
                self._pool = LinkPool(LINK_THREADS, self._name)
            return self._pool

    def close(self) -> None:
        """Cancels the futures not started yet and closes the link (not the gRPC channel); a
        call after this fails as UNAVAILABLE."""
        with self._lock:
            self._closed = True
        if self._pool is not None:
            self._pool.close()
        if self.link is not None:
            self.link.close()
