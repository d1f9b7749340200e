"""The controller's end of the local link (see `colocar.protocol.link`).

Each controller thread gets its own Unix socket to the sidecar, opened on first use, so a
thread's synchronous calls keep their order and never wait on another thread's. A wait for a
reply wakes every `poll` seconds to see whether the heartbeat declared the host lost (a stopped
sidecar never answers); a timed-out or broken socket is closed and reopened for the next call.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from colocar.protocol import link


class LinkError(grpc.RpcError):
    """A link failure in the shape of a grpc.RpcError, so one error translation serves both."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_CODES = {code.value[0]: code for code in grpc.StatusCode}


class LinkClient:
    def __init__(self, path: str, token: str, lost: Callable[[], bool], poll: float):
        self.path = path
        self._token = token.encode()
        self._lost = lost
        self._poll = poll
        self._local = threading.local()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self._socket().close()  # fail now, not at the first call, if the link is unreachable
        self._local.sock = None

    def _socket(self, timeout: float = 10.0) -> socket.socket:
        sock = getattr(self._local, "sock", None)
        if sock is not None:
            return sock
        if self._closed:
            raise LinkError(grpc.StatusCode.UNAVAILABLE, "the local link is closed")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(self.path)
            link.send_request(sock, link.HELLO, self._token)
            status, body = link.parse_reply(link.recv_frame(sock))
        except BaseException:
            sock.close()
            raise
        if status != 0:
            sock.close()
            raise LinkError(_CODES.get(status, grpc.StatusCode.UNKNOWN), body.decode(errors="replace"))
        sock.settimeout(self._poll)
        with self._lock:
            if self._closed:  # closed while we connected: close() did not see this socket
                sock.close()
                raise LinkError(grpc.StatusCode.UNAVAILABLE, "the local link is closed")
            self._sockets.append(sock)
        self._local.sock = sock
        return sock

    def _drop(self) -> None:
        sock = getattr(self._local, "sock", None)
        self._local.sock = None
        if sock is not None:
            with self._lock:
                if sock in self._sockets:
                    self._sockets.remove(sock)
            sock.close()

    def call(self, method: str, request: Any, reply_type: Any, timeout: float | None) -> Any:
        """One unary call; raises LinkError (with gRPC status codes) like a stub would."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            sock = self._socket(10.0 if timeout is None else max(0.05, min(10.0, timeout)))
            link.send_request(sock, method, request.SerializeToString())
            frame = self._receive(sock, deadline)
        except LinkError:
            self._drop()
            raise
        except TimeoutError:  # no answer to the connection's hello within the deadline
            self._drop()
            raise LinkError(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer on the local link") from None
        except (OSError, link.LinkClosed) as e:
            self._drop()
            raise LinkError(grpc.StatusCode.UNAVAILABLE, f"local link broke: {e}") from None
        status, body = link.parse_reply(frame)
        if status != 0:
            raise LinkError(_CODES.get(status, grpc.StatusCode.UNKNOWN), body.decode(errors="replace"))
        return reply_type.FromString(body)

    def _receive(self, sock: socket.socket, deadline: float | None) -> bytes:
        (length,) = link.LENGTH.unpack(self._read(sock, 4, deadline))
        if length > link.MAX_FRAME:
            raise link.LinkClosed(f"reply frame of {length} bytes exceeds {link.MAX_FRAME}")
        return self._read(sock, length, deadline)

    def _read(self, sock: socket.socket, n: int, deadline: float | None) -> bytes:
        """n bytes; waits in `poll` slices, giving up when the host is lost or the deadline passed."""
        buffer = bytearray()
        last_look = False
        while len(buffer) < n:
            try:
                chunk = sock.recv(min(n - len(buffer), 1 << 20))
            except TimeoutError:
                if last_look:
                    raise LinkError(
                        grpc.StatusCode.UNAVAILABLE, "host lost while waiting for the reply"
                    ) from None
                if self._lost() or self._closed:
                    last_look = True  # the reply may have landed just before the sidecar went
                    sock.settimeout(0.05)
                    continue
                if deadline is not None and time.monotonic() > deadline:
                    raise LinkError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded") from None
                continue
            if not chunk:
                raise link.LinkClosed("link closed by the sidecar")
            buffer += chunk
        if last_look:
            sock.settimeout(self._poll)
        return bytes(buffer)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread waiting in recv (a log poll)
            except OSError:
                pass
            try:
                sock.close()
            except OSError:
                pass
