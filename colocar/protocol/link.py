"""The local link: unary RPCs of the Sidecar service over a Unix socket, for same-host callers.

A synchronous gRPC call in Python costs about 600 us on these machines, ten times a socket
round trip. A controller on the sidecar's host (the case shared memory already needs) sends
its synchronous unary calls here instead: the same protobuf messages and the same servicer
methods, framed on a Unix socket in the sidecar's shm directory (mode 0600). The first frame
carries the token; a wrong one closes the connection. Streams and uploads stay on gRPC.
Keepalives go over the link too: only an answer from the sidecar's own process tells that calls
waiting on the link may still complete (a draining sidecar refuses new gRPC calls). Log lines
are long-polled (`PollLogs`) here too: the waiting thread sleeps in one socket read.

Limits: a request may be `MAX_REQUEST` bytes (the same on gRPC: bulk data travels in arena
blocks or 1 MiB chunks, so the largest message a controller sends is a function's code), a
hello `MAX_HELLO`; a reply `MAX_FRAME`.

Frames: request `u32 length | u8 method length | method | message`;
reply `u32 length | u8 status (a `status.Status`, gRPC's numbering; 0 = OK) | message or
error details`.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

from . import colocar_pb2 as pb

MAX_FRAME = 64 << 20  # a reply (the sidecar's send limit on gRPC too)
MAX_REQUEST = 16 << 20  # a request's message, on the link and on gRPC
MAX_HELLO = 4096  # the first frame of a connection: the method name and the token
HELLO = "hello"
# The unary Sidecar methods served on the link; their message types come from the proto.
_SERVED = (
    "Call",
    "Allocate",
    "Release",
    "DeleteObject",
    "FindObject",
    "Stats",
    "Disconnect",
    "Keepalive",
    "PollLogs",
    "Cancel",
)
_SERVICE = pb.DESCRIPTOR.services_by_name["Sidecar"]
METHODS: dict[str, tuple[Any, Any]] = {
    name: (
        getattr(pb, _SERVICE.methods_by_name[name].input_type.name),
        getattr(pb, _SERVICE.methods_by_name[name].output_type.name),
    )
    for name in _SERVED
}  # method -> (request type, reply type)
LENGTH = struct.Struct("!I")
_REPLY_HEAD = struct.Struct("!IB")  # a reply's length and status
READ_BYTES = 64 << 10  # what a serving end reads at once: most requests, whole


class LinkClosed(ConnectionError):
    """The other end closed the link (or sent a frame we cannot accept)."""


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise LinkClosed("link closed by peer")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket, limit: int = MAX_FRAME) -> bytes:
    """One frame's content; a frame over `limit` bytes closes the link before it is read."""
    (length,) = LENGTH.unpack(_recv_exactly(sock, 4))
    if length > limit:
        raise LinkClosed(f"frame of {length} bytes exceeds {limit}")
    return _recv_exactly(sock, length)


class FrameReader:
    """A connection's frames, read in as few `recv`s as they allow (a small request comes in
    one, header and all); bytes past a frame are kept for the next. For the serving end,
    whose reads no interrupt cuts short."""

    __slots__ = ("_sock", "_rest")

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._rest = b""

    def frame(self, limit: int = MAX_FRAME) -> bytes:
        """As `recv_frame`: a frame over `limit` bytes closes the link before its body is read."""
        data = self._rest
        while len(data) < 4:
            data += self._more(READ_BYTES)
        (length,) = LENGTH.unpack_from(data)
        if length > limit:
            raise LinkClosed(f"frame of {length} bytes exceeds {limit}")
        end = 4 + length
        if len(data) < end:
            chunks, have = [data], len(data)
            while have < end:
                chunk = self._more(min(end - have, 1 << 20))
                chunks.append(chunk)
                have += len(chunk)
            data = b"".join(chunks)
        self._rest = data[end:]
        return data[4:end]

    def _more(self, n: int) -> bytes:
        chunk = self._sock.recv(n)
        if not chunk:
            raise LinkClosed("link closed by peer")
        return chunk


class ReplyFrame:
    """A reply frame being read (by the controller), so that a read cut short (an interrupt, a
    wait's limit) can be finished: by the drain of an abandoned call, or by a later read.

    Bytes are only ever consumed by `recv_into` this frame's buffer, once the header was
    peeked: an interrupt after a `recv_into` returned loses its count, never its bytes, and the
    drain recovers the count from what is left before the end of the stream.
    """

    __slots__ = ("buffer", "taken")

    def __init__(self) -> None:
        self.buffer: bytearray | None = None  # header and body, allocated once the header is seen
        self.taken = 0  # bytes of `buffer` known to be received

    def open(self, header: bytes) -> None:
        (length,) = LENGTH.unpack(header)
        if length > MAX_FRAME:
            raise LinkClosed(f"reply frame of {length} bytes exceeds {MAX_FRAME}")
        self.buffer = bytearray(4 + length)

    def body(self) -> memoryview:
        """The frame's content, in place (protobuf parses it without a copy)."""
        assert self.buffer is not None
        return memoryview(self.buffer)[4:]


def request_frame(method: str, message: bytes) -> bytes:
    name = method.encode()
    return LENGTH.pack(1 + len(name) + len(message)) + bytes([len(name)]) + name + message


def send_request(sock: socket.socket, method: str, message: bytes) -> None:
    sock.sendall(request_frame(method, message))


def parse_request(frame: bytes) -> tuple[str, bytes]:
    if not frame:
        raise LinkClosed("empty request frame")
    n = frame[0]
    return frame[1 : 1 + n].decode(errors="replace"), frame[1 + n :]


def send_reply(sock: socket.socket, status: int, body: bytes) -> None:
    sock.sendall(_REPLY_HEAD.pack(1 + len(body), status) + body)


def parse_reply(frame: bytes | memoryview) -> tuple[int, bytes | memoryview]:
    if not frame:
        raise LinkClosed("empty reply frame")
    return frame[0], frame[1:]
