"""The controller's session with one sidecar: connect, keepalive, lost, generation.

`connect` checks the token and the versions (the sidecar refuses a skew) and opens the session,
which the sidecar keeps for `lease_seconds` after the last sign of life. A heartbeat thread
renews it; it reconnects after a sidecar restart (a new `generation`: remote objects of older
ones are gone) and marks the host lost when the sidecar stops answering.

An unanswered keepalive alone does not make a host lost: a sidecar's Python can be busy for
seconds in a call that holds the GIL (a C extension's, or its first import), and a false loss starts
an elastic recovery on a healthy host. The session then probes the process with a new
connection, which gRPC's core completes without the GIL (`accepts_connections`): a stopped,
dead or cut-off sidecar fails it and is lost at once, a busy one passes and is waited for,
up to `hung_seconds` of silence (then it is taken for hung and lost too).
"""

from __future__ import annotations

import itertools
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from colocar.errors import (
    AuthError,
    ColocarError,
    HostLostError,
    QuotaExceededError,
    SessionEndedError,
    VersionSkewError,
)
from colocar.protocol import colocar_pb2 as pb
from colocar.protocol import versions
from colocar.protocol.status import QUOTA_REACHED, Status, TransportError

from .transport import GrpcTransport, Transport


@dataclass(frozen=True)
class SessionName:
    """A named session's name ("" for none) and the grace it asks for (0: the sidecar's)."""

    name: str = ""
    grace_seconds: float = 0.0


UNNAMED = SessionName()


class Session:
    """The session with one sidecar and its liveness."""

    def __init__(
        self,
        address: str,
        name: str,
        transport: Transport,
        grpc_transport: GrpcTransport,
        on_connect: Callable[[pb.ConnectReply], None],
        *,
        lease_seconds: float,
        heartbeat_seconds: float,
        process_status: Callable[[], str | None] | None = None,
        named: SessionName = UNNAMED,
        mapping: Callable[[], int] = lambda: 0,
    ):
        self.address = address
        self.name = name
        self.lease_seconds = lease_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self.session_id = uuid.uuid4().hex
        self.session_name = named.name  # a named session outlives this controller (its grace)
        self.grace_seconds = named.grace_seconds  # asked (0: the sidecar's); then the sidecar's answer
        self.took_over = ""  # the controller whose session of the same name the first connect took over
        self.lost: HostLostError | None = None
        self.ended: SessionEndedError | None = None  # taken over or closed from elsewhere
        self.unresponsive = False  # no answer at all, not even a refusal
        self.generation = 0  # bumped at every (re)connect: remote objects of older ones are gone
        self.known_code: set[bytes] = set()  # code hashes the sidecar has
        self.closed = False
        self.info = pb.ConnectReply()
        self.alive_at = 0.0  # monotonic time the sidecar last proved alive (a keepalive, a batch fed)
        self.keepalive_seconds = max(2.0, 3 * heartbeat_seconds)  # a keepalive's wait for its answer
        # Silence after which a sidecar that still accepts connections is taken for hung.
        self.hung_seconds = max(lease_seconds, 10 * self.keepalive_seconds)
        self.busy_spells = 0  # keepalives unanswered while the process accepted connections
        self._answered_at = 0.0  # the sidecar last answered (a connect or a keepalive)
        self._renewed_at = 0.0  # the session's lease was last renewed
        self._transport = transport
        self._grpc = grpc_transport
        self._on_connect = on_connect  # maps the arena, opens the link
        self._process_status = process_status
        self._mapping = mapping  # where this controller maps the sidecar's arena (0: nowhere)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._call_ids = itertools.count(1)

    def connect(self, timeout: float) -> pb.ConnectReply:
        """Opens (or reopens) the session; raises AuthError, VersionSkewError or HostLostError."""
        local = versions.local_versions()
        request = pb.ConnectRequest(
            session_id=self.session_id,
            python_version=local["python"],
            cloudpickle_version=local["cloudpickle"],
            jax_version=local["jax"],
            sys_path=[p for p in sys.path if p],
            cwd=os.getcwd(),
            lease_seconds=self.lease_seconds,
            controller=f"{socket.gethostname()}:{os.getpid()}",
            session_name=self.session_name,
            grace_seconds=self.grace_seconds,
        )
        try:
            reply = self._grpc.connect(request, timeout)
        except TransportError as e:
            raise self._connect_error(e) from None
        if self.generation == 0:
            self.took_over = reply.took_over
        self.grace_seconds = reply.grace_seconds
        self._answered_at = time.monotonic()
        self.generation += 1
        self.known_code.clear()
        self.lost = None
        self.unresponsive = False
        self._on_connect(reply)
        self.info = reply
        self._report_mapping()
        return reply

    def _report_mapping(self) -> None:
        """Tells the sidecar at once where this process maps its arena (keepalives repeat it):
        when the session ends, the sidecar keeps the blocks this mapping may still show."""
        mapping = self._mapping()
        if mapping:
            try:
                request = pb.SessionRef(session_id=self.session_id, mapping=mapping)
                self._transport.call("Keepalive", request, self.keepalive_seconds)
            except TransportError:
                pass  # the heartbeat says it again

    def next_call_id(self) -> int:
        """An id for a call, unique in this session (a Cancel names calls by it)."""
        return next(self._call_ids)

    def _connect_error(self, e: TransportError) -> ColocarError:
        if e.status == Status.UNAUTHENTICATED:
            return AuthError(
                f"sidecar {self.name} at {self.address} refused the token: pass the token the "
                "sidecar was started with (connect(token=...), COLOCAR_TOKEN or COLOCAR_TOKEN_FILE)"
            )
        if e.status == Status.FAILED_PRECONDITION:
            return VersionSkewError(f"sidecar {self.name} at {self.address}: {e.details}")
        if e.status == Status.ABORTED:
            self.mark_ended(e.details)
            return SessionEndedError(str(self.ended) if self.ended else e.details)
        if e.status == Status.RESOURCE_EXHAUSTED and QUOTA_REACHED in e.details:
            return QuotaExceededError(f"sidecar {self.name} at {self.address}: {e.details}")
        return HostLostError(f"cannot reach sidecar {self.name} at {self.address}: {e.details}")

    def start(self) -> None:
        """Starts the heartbeat."""
        self._renewed_at = time.monotonic()
        self._thread = threading.Thread(
            target=self._heartbeat_loop, name=f"colocar-heartbeat-{self.name}", daemon=True
        )
        self._thread.start()

    def _heartbeat_loop(self) -> None:
        """A keepalive every heartbeat period, except while other traffic (a batch feed) shows
        the sidecar alive: then only often enough to renew the session's lease. Once that
        traffic stops, keepalives resume within two periods."""
        while not self._stop.wait(self.heartbeat_seconds):
            reason = self._process_status() if self._process_status else None
            if reason is not None:
                self.unresponsive = True
                self.mark_lost(reason)
                return
            now = time.monotonic()
            proven = now - self.alive_at < self.heartbeat_seconds
            if proven and now - self._renewed_at < self.lease_seconds / 3:
                continue
            try:
                self.heartbeat()
            except ValueError:  # gRPC's "closed channel": the connection closed under this beat
                if self.closed:
                    return
                raise

    def heartbeat(self) -> None:
        """Renews the session; reconnects after a sidecar restart; marks the host lost when silent."""
        if self.closed or self.ended is not None:
            return
        try:
            request = pb.SessionRef(session_id=self.session_id, mapping=self._mapping())
            reply = self._transport.call("Keepalive", request, self.keepalive_seconds)
        except TransportError as e:
            if e.status == Status.ABORTED:  # taken over, or closed from elsewhere
                self.mark_ended(e.details)
                return
            if e.status == Status.UNAUTHENTICATED:  # a rotated token: calls raise AuthError,
                return  # the host is not lost
            silent = e.status == Status.DEADLINE_EXCEEDED
            why = f"no answer to keepalive ({e.status.name}: {e.details})"
            if silent:
                busy_or_why = self._busy_or_why(why)
                if busy_or_why is None:
                    return  # busy, not lost: calls waiting on it keep waiting
                why = busy_or_why
            # Silence (stopped, hung, cut off) also ends calls waiting on the local link; a
            # refusal (a draining sidecar) only stops new calls. A dead sidecar closes the link.
            self.unresponsive = silent
            self.mark_lost(why)
            return
        self.alive_at = self._renewed_at = self._answered_at = time.monotonic()
        if not reply.known or self.lost is not None:
            try:
                self.connect(timeout=self.keepalive_seconds)
            except ColocarError as e:
                self.mark_lost(str(e))

    def _busy_or_why(self, why: str) -> str | None:
        """After a keepalive went unanswered: None while the sidecar's process accepts a new
        connection and has been silent less than `hung_seconds` (busy holding its GIL), else
        why it is lost."""
        silent_for = time.monotonic() - max(self._answered_at, self.alive_at)
        if silent_for >= self.hung_seconds:
            return f"{why}; silent for {silent_for:.1f} s though it accepts connections: hung"
        if not self._grpc.accepts_connections(timeout=max(1.0, self.heartbeat_seconds)):
            return f"{why}; it accepts no connection either (stopped, dead or cut off)"
        self.busy_spells += 1
        return None

    def mark_lost(self, reason: str) -> None:
        if self.lost is None and not self.closed and self.ended is None:
            self.lost = HostLostError(f"sidecar {self.name} at {self.address} is lost: {reason}")

    def mark_ended(self, reason: str) -> None:
        """The sidecar ended this session from elsewhere (`reason` says who): it is not lost,
        but nothing more can be done with it; the heartbeat stops."""
        if self.ended is None and not self.closed:
            self.ended = SessionEndedError(
                f"sidecar {self.name} at {self.address}: {reason}; this connection can do nothing "
                "more (its remote objects there are gone; arrays it returned stay valid). Connect "
                "again, and make anew on that cluster what used this one: loaders "
                "(colocar.loaders.load, from a saved get_state) and checkpoint managers "
                "(CheckpointManager(directory, cluster): committed steps stay in storage)"
            )
            self._stop.set()

    def check_alive(self) -> None:
        if self.closed:
            raise ColocarError(f"connection to sidecar {self.name} is closed")
        if self.ended is not None:
            raise SessionEndedError(str(self.ended))
        if self.lost is not None:
            raise HostLostError(str(self.lost))

    def wait_closed(self, timeout: float) -> bool:
        """Waits up to `timeout` for close(); True once closed (a retry loop's pause that
        close ends at once)."""
        return self._stop.wait(timeout)

    def close(self) -> None:
        """Stops the heartbeat and ends the session on the sidecar (if it still answers)."""
        mapping = self._mapping()
        self.closed = True
        self._stop.set()
        if self.lost is None and self.ended is None:
            try:
                request = pb.SessionRef(session_id=self.session_id, mapping=mapping)
                self._grpc.call("Disconnect", request, timeout=5)
            except TransportError:
                pass
