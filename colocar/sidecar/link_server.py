"""Serves the local link (see `colocar.protocol.link`) with the sidecar's own handlers.

Runs in the sidecar: one accept thread, one thread per connection (a controller thread that
makes synchronous calls). A connection proves the token once, in its hello; then each request
goes to the handler of its method (the same as gRPC's, with the same session and bounds
checks), and a `Refused` comes back as a status frame.

A connection that has not proved the token yet is bounded: its hello must come within
`HELLO_SECONDS` and fit `link.MAX_HELLO`, and at most `MAX_UNPROVEN` such connections are kept
(a new one closes the oldest), apart from the proven ones: idle strangers can neither exhaust
the sidecar's threads nor keep a controller's new connection out.
"""

from __future__ import annotations

import collections
import contextlib
import os
import socket
import threading
import time

from colocar.protocol import link
from colocar.protocol.status import Refused, Status

from .auth import Token
from .service import SidecarService

MAX_CONNECTIONS = 1024  # proven connections (a controller opens one per calling thread)
MAX_UNPROVEN = 64  # connections waiting for their hello; a new one closes the oldest
HELLO_SECONDS = 5.0  # how long a connection may take to send its hello
MAX_REQUEST_FRAME = link.MAX_REQUEST + 256  # the message, its method's name and length


class LinkServer:
    def __init__(self, service: SidecarService, path: str, token: Token):
        self._service = service
        self._token = token
        self.path = path
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket file is created 0600
        try:
            self._listener.bind(path)
        finally:
            os.umask(old_umask)
        # A deep backlog: a burst of connections must not refuse a controller's (a full backlog
        # fails a connect at once, and the controller would take the sidecar for lost).
        self._listener.listen(socket.SOMAXCONN)
        self._connections: set[socket.socket] = set()  # proven
        self._unproven: collections.OrderedDict[socket.socket, None] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        self._serving: set[socket.socket] = set()  # connections running a call (set.add: no lock)
        threading.Thread(target=self._accept, name="colocar-link-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if len(self._unproven) >= MAX_UNPROVEN:
                    oldest, _ = self._unproven.popitem(last=False)
                    with contextlib.suppress(OSError):  # its thread sees the end and closes it
                        oldest.shutdown(socket.SHUT_RDWR)
                self._unproven[conn] = None
            threading.Thread(target=self._serve, args=(conn,), name="colocar-link", daemon=True).start()

    def _hello(self, conn: socket.socket, reader: link.FrameReader) -> int | None:
        """Reads the hello within `HELLO_SECONDS`; the token generation the connection proved
        once it counts as proven (None: it was answered, or dropped, and must be closed)."""
        conn.settimeout(HELLO_SECONDS)
        method, token = link.parse_request(reader.frame(link.MAX_HELLO))
        proven = self._token.proven_by(token) if method == link.HELLO else None
        if proven is None:
            link.send_reply(conn, Status.UNAUTHENTICATED, b"missing or wrong colocar token")
            return None
        with self._lock:
            dropped = conn not in self._unproven  # as the oldest unproven one, meanwhile
            self._unproven.pop(conn, None)
            if dropped or len(self._connections) >= MAX_CONNECTIONS:
                return None
            self._connections.add(conn)
        conn.settimeout(None)
        link.send_reply(conn, Status.OK, b"")
        return proven

    def _serve(self, conn: socket.socket) -> None:
        try:
            reader = link.FrameReader(conn)
            proven = self._hello(conn, reader)
            if proven is None:
                return
            serving = self._serving
            while True:
                method, body = link.parse_request(reader.frame(MAX_REQUEST_FRAME))
                if self._token.generation != proven:  # rotated: this connection proved the old one
                    link.send_reply(conn, Status.UNAUTHENTICATED, b"the colocar token changed; reconnect")
                    return
                serving.add(conn)
                try:
                    status, reply = self._handle(method, body)
                    link.send_reply(conn, status, reply)
                finally:
                    serving.discard(conn)
        except (link.LinkClosed, OSError):  # TimeoutError (a late hello) included
            pass
        finally:
            with self._lock:
                self._connections.discard(conn)
                self._unproven.pop(conn, None)
            conn.close()

    def _handle(self, method: str, body: bytes) -> tuple[int, bytes]:
        types = link.METHODS.get(method)
        if types is None:
            return Status.UNIMPLEMENTED, f"{method} is not served on the link".encode()
        try:
            request = types[0].FromString(body)
        except Exception:
            return Status.INVALID_ARGUMENT, b"undecodable request"
        try:
            reply = getattr(self._service, method)(request)
        except Refused as e:
            return e.status, e.details.encode()
        except Exception as e:  # noqa: BLE001 - a handler bug must not kill the link
            return Status.UNKNOWN, f"{type(e).__name__}: {e}".encode()
        return Status.OK, reply.SerializeToString()

    def drain(self, timeout: float) -> bool:
        """Waits until no link call is running (after `close`); True if none is left."""
        deadline = time.monotonic() + timeout
        while self._serving and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self._serving

    def close(self) -> None:
        """Stops accepting connections. Open ones keep serving (keepalives are answered while
        the sidecar drains; new calls are refused by the service) until the process exits."""
        self._closed = True
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
