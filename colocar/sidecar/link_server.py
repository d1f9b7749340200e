"""Serves the local link (see `colocar.protocol.link`) with the sidecar's own handlers.

Runs in the sidecar: one accept thread, one thread per connection (a controller thread that
makes synchronous calls). A connection proves the token once, in its hello; then each request
goes to the handler of its method (the same as gRPC's, with the same session and bounds
checks), and a `Refused` comes back as a status frame.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import socket
import threading
import time

from colocar.protocol import link
from colocar.protocol.status import Refused, Status

from .service import SidecarService

MAX_CONNECTIONS = 1024


class LinkServer:
    def __init__(self, service: SidecarService, path: str, token: str | None):
        self._service = service
        self._token = token or ""
        self.path = path
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket file is created 0600
        try:
            self._listener.bind(path)
        finally:
            os.umask(old_umask)
        self._listener.listen(64)
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._busy = 0
        threading.Thread(target=self._accept, name="colocar-link-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if len(self._connections) >= MAX_CONNECTIONS:
                    conn.close()
                    continue
                self._connections.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="colocar-link", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            method, token = link.parse_request(link.recv_frame(conn))
            if method != link.HELLO or not hmac.compare_digest(token, self._token.encode()):
                link.send_reply(conn, Status.UNAUTHENTICATED, b"missing or wrong colocar token")
                return
            link.send_reply(conn, Status.OK, b"")
            while True:
                method, body = link.parse_request(link.recv_frame(conn))
                with self._lock:
                    self._busy += 1
                try:
                    status, reply = self._handle(method, body)
                    link.send_reply(conn, status, reply)
                finally:
                    with self._lock:
                        self._busy -= 1
        except (link.LinkClosed, OSError):
            pass
        finally:
            with self._lock:
                self._connections.discard(conn)
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
        while self._busy and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self._busy

    def close(self) -> None:
        """Stops accepting connections. Open ones keep serving (keepalives are answered while
        the sidecar drains; new calls are refused by the service) until the process exits."""
        self._closed = True
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
