"""The sidecar's session handlers: connect, keepalive, disconnect, and sessions seen from outside.

Runs in the sidecar; a mixin of `SidecarService` (which holds the tables it uses). Connect
checks versions and opens the session; a named session connected to by a new controller is
taken over there: its named objects pass to the new session, the rest of what it held is
freed (blocks its old controller may still map stay until it no longer does, `held_blocks`).
`ListSessions` and `CloseSession` serve `colocar sessions ls|close`.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING

from colocar.protocol import colocar_pb2 as pb
from colocar.protocol import versions
from colocar.protocol.status import Refused, Status

from .sessions import LAPSED, TAKEN_OVER, Session, SessionGone

if TYPE_CHECKING:
    from .blocks import SidecarArena
    from .held_blocks import HeldBlocks
    from .objects import ObjectTable
    from .quotas import Quotas
    from .sessions import SessionTable

UNKNOWN_SESSION = "unknown session"


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class SessionHandlers:
    """The session RPCs of `SidecarService`, and the check every other handler makes."""

    id: str
    arena: SidecarArena
    objects: ObjectTable
    held: HeldBlocks
    sessions: SessionTable
    draining: bool
    link_path: str
    quotas: Quotas
    connect_lock: threading.Lock  # a sessions quota's check and the open, together

    def session(self, session_id: str) -> Session:
        """The caller's live session; refuses while draining, for an unknown session, and for
        one taken over or closed from outside (ABORTED, saying by whom)."""
        if self.draining:
            raise Refused(Status.UNAVAILABLE, "sidecar is shutting down")
        try:
            session = self.sessions.get(session_id)
        except SessionGone as e:
            raise Refused(Status.ABORTED, str(e)) from None
        if session is None:
            raise Refused(
                Status.FAILED_PRECONDITION,
                f"{UNKNOWN_SESSION} {session_id!r}: it expired or the sidecar restarted; reconnect",
            )
        return session

    def _session_ended(self, session: Session, how: str) -> None:
        self.objects.drop_session(session.id)
        self.held.session_ended(session.id, session.controller, session.mapping, comes_back=how == LAPSED)

    def Connect(self, request: pb.ConnectRequest) -> pb.ConnectReply:
        if self.draining:
            raise Refused(Status.UNAVAILABLE, "sidecar is shutting down")
        self._check_versions(request)
        for entry in request.sys_path:
            if entry and entry not in sys.path and os.path.isdir(entry):
                sys.path.append(entry)
        if request.cwd and os.path.isdir(request.cwd):
            os.chdir(request.cwd)
        self.held.reconnected(request.session_id)
        try:
            with self.connect_lock:
                self._check_sessions_quota(request)
                session, previous = self.sessions.open(
                    request.session_id,
                    request.controller,
                    request.lease_seconds,
                    request.session_name,
                    request.grace_seconds,
                )
        except SessionGone as e:
            raise Refused(Status.ABORTED, str(e)) from None
        self.arena.allocator.reopen_owner(session.id)  # a session closed, then opened again
        if previous is not None:  # its named objects are the new controller's; the rest goes
            self.objects.move_named(previous.id, session.id)
            self.sessions.end(previous, TAKEN_OVER)
        a = self.arena.arena
        return pb.ConnectReply(
            sidecar_id=self.id,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            boot_id=_boot_id(),
            arena_path=a.path,
            arena_size=a.size,
            arena_nonce=a.nonce,
            lease_seconds=session.lease_seconds,
            colocar_version=versions.colocar_version(),
            link_path=self.link_path,
            grace_seconds=session.grace_seconds,
            took_over=previous.controller if previous is not None else "",
        )

    def _check_sessions_quota(self, request: pb.ConnectRequest) -> None:
        """A new session counts against the tenant's quota; a reconnect or a takeover does not."""
        if not self.quotas.sessions:
            return
        held = self.sessions.list()
        name = request.session_name
        if any(s.id == request.session_id or (name and s.name == name) for s in held):
            return
        self.quotas.check_new_session([s.name or s.id[:8] for s in held])

    def _check_versions(self, request: pb.ConnectRequest) -> None:
        controller = {
            "python": request.python_version,
            "cloudpickle": request.cloudpickle_version,
            "jax": request.jax_version,
        }
        problems = versions.skew(controller, versions.local_versions())
        if problems:
            raise Refused(
                Status.FAILED_PRECONDITION,
                "version skew between controller and sidecar: "
                + "; ".join(problems)
                + ". Build the sidecar image from the same environment as the trainer.",
            )

    def Keepalive(self, request: pb.SessionRef) -> pb.KeepaliveReply:
        try:
            session = self.sessions.get(request.session_id)
        except SessionGone as e:
            raise Refused(Status.ABORTED, str(e)) from None
        if session is not None and request.mapping:
            session.mapping = request.mapping
        return pb.KeepaliveReply(known=session is not None)

    def Disconnect(self, request: pb.SessionRef) -> pb.Empty:
        try:
            session = self.sessions.get(request.session_id)
        except SessionGone:
            return pb.Empty()  # ended already
        if session is not None and request.mapping:
            session.mapping = request.mapping
        self.sessions.close(request.session_id)
        return pb.Empty()

    def ListSessions(self, request: pb.Empty) -> pb.SessionList:
        now = time.monotonic()
        return pb.SessionList(sessions=[self._info(s, now) for s in self.sessions.list()])

    def CloseSession(self, request: pb.SessionSelector) -> pb.SessionList:
        if not request.selector:
            raise Refused(Status.INVALID_ARGUMENT, "name the session to close (its name or id prefix)")
        now = time.monotonic()
        closed = self.sessions.close_from_outside(request.selector, request.by or "colocar sessions close")
        return pb.SessionList(sessions=[self._info(s, now) for s in closed])

    def _info(self, session: Session, now: float) -> pb.SessionInfo:
        return pb.SessionInfo(
            id_prefix=session.id[:8],
            name=session.name,
            controller=session.controller,
            attached=not session.detached,
            idle_seconds=max(0.0, now - (session.expires_at - session.lease_seconds)),
            lease_seconds=session.lease_seconds,
            grace_seconds=session.grace_seconds,
            grace_left_seconds=session.grace_left(now) or 0.0,
            objects=self.objects.count(session.id),
            arena_bytes=self.arena.allocator.owned_bytes(session.id),
        )
