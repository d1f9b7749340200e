"""The controller's end of the local link (see `colocar.protocol.link`).

Each controller thread gets its own Unix socket to the sidecar, opened on first use, so a
thread's synchronous calls keep their order and never wait on another thread's. A wait for a
reply wakes every `poll` seconds to see whether the heartbeat declared the host lost (a stopped
sidecar never answers). A call cut short (an interrupt, its deadline) retires its socket: the
next call opens a fresh one, so no reply can ever answer the wrong request.
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


class _Frame:
    """A reply frame as far as it was read, so that a drain can finish a read cut short."""

    __slots__ = ("data", "length")

    def __init__(self) -> None:
        self.data = bytearray()
        self.length = -1  # of the body, once the header was read

    def missing(self) -> int:
        if self.length < 0 and len(self.data) >= 4:
            (self.length,) = link.LENGTH.unpack(self.data[:4])
            if self.length > link.MAX_FRAME:
                raise link.LinkClosed(f"reply frame of {self.length} bytes exceeds {link.MAX_FRAME}")
        return (4 if self.length < 0 else 4 + self.length) - len(self.data)

    def add(self, chunk: bytes) -> None:
        self.data += chunk

    def body(self) -> bytes:
        return bytes(self.data[4:])


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

    def _forget(self, sock: socket.socket) -> None:
        """Closes a socket this client will not use again."""
        with self._lock:
            if sock in self._sockets:
                self._sockets.remove(sock)
        sock.close()

    def call(
        self,
        method: str,
        request: Any,
        reply_type: Any,
        timeout: float | None,
        abandoned: Callable[[Any], None] | None = None,
    ) -> Any:
        """One unary call; raises LinkError (with gRPC status codes) like a stub would.

        The thread's socket is taken for the call and given back only once the whole reply was
        read: a call cut short by anything (an interrupt, any exception, its deadline) leaves
        the thread without a socket, so the next call opens a fresh one and can never read
        this call's reply. The reply is still read, in the background, and handed to
        `abandoned` (which frees what it carries), unless the link broke.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        frame = _Frame()
        sock = None
        sent = False
        try:
            sock = self._socket(10.0 if timeout is None else max(0.05, min(10.0, timeout)))
            self._local.sock = None  # taken: back only after a complete reply
            link.send_request(sock, method, request.SerializeToString())
            sent = True
            self._read_frame(sock, frame, deadline)
        except TimeoutError:  # no answer to the connection's hello within the deadline
            self._give_up(sock, None)
            raise LinkError(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer on the local link") from None
        except (OSError, link.LinkClosed) as e:
            self._give_up(sock, None)
            raise LinkError(grpc.StatusCode.UNAVAILABLE, f"local link broke: {e}") from None
        except LinkError as e:
            timed_out = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            self._give_up(sock, (frame, reply_type, abandoned) if sent and timed_out else None)
            raise
        except BaseException:  # an interrupt: the reply may still come
            self._give_up(sock, (frame, reply_type, abandoned) if sent else None)
            raise
        self._local.sock = sock
        status, body = link.parse_reply(frame.body())
        if status != 0:
            raise LinkError(_CODES.get(status, grpc.StatusCode.UNKNOWN), body.decode(errors="replace"))
        return reply_type.FromString(body)

    def _give_up(self, sock: socket.socket | None, drain: tuple[_Frame, Any, Any] | None) -> None:
        """Retires the socket of a call cut short; with `drain`, its reply is read first."""
        if sock is None:
            return
        if drain is None or drain[2] is None:
            self._forget(sock)
            return
        threading.Thread(
            target=self._drain, args=(sock, *drain), name="colocar-link-drain", daemon=True
        ).start()

    def _drain(self, sock: socket.socket, frame: _Frame, reply_type: Any, abandoned: Any) -> None:
        """Background: reads the reply of an abandoned call and hands it over, then closes."""
        try:
            self._read_frame(sock, frame, None)
            status, body = link.parse_reply(frame.body())
            if status == 0:
                abandoned(reply_type.FromString(body))
        except Exception:  # noqa: BLE001 - a lost link: the session's lease frees what it held
            pass
        finally:
            self._forget(sock)

    def _read_frame(self, sock: socket.socket, frame: _Frame, deadline: float | None) -> None:
        """Reads the rest of `frame`; waits in `poll` slices, giving up when the host is lost or
        the deadline passed."""
        last_look = False
        while (need := frame.missing()) > 0:
            try:
                chunk = sock.recv(min(need, 1 << 20))
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
            frame.add(chunk)
        if last_look:
            sock.settimeout(self._poll)

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
