"""The controller's end of the local link (see `colocar.protocol.link`).

A call takes a Unix socket to the sidecar for itself, from the idle ones or opened anew, and
gives it back once its whole reply was read: calls never wait on each other's replies. A call
is sent (`send`) and its reply read (`PendingReply.read`) in two steps, so that a future's
reply can be read by the thread that waits for it, with no thread in between. A wait for a
reply wakes every `poll` seconds to see whether the heartbeat declared the host lost (a stopped
sidecar never answers). A call cut short (an interrupt, its deadline) retires its socket, so
no reply can ever answer the wrong request; a wait with a limit of its own (`result(timeout)`)
that passes stops reading, and the reply is read on later from where it stopped.

A socket is closed only by the thread using it, or while no thread does (under the client's
lock): closing a descriptor another thread is reading would make it fail with EBADF, or,
once the number is reused by a new socket, read someone else's reply. A link replaced at a
reconnect is `retire`d: calls in flight on it finish there, calls not yet sent raise
`LinkGone` (the transport sends them on the new link). `close` wakes the calls in flight too.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from colocar.protocol import link
from colocar.protocol.status import Status, TransportError


class NotYet(Exception):
    """A wait's own limit passed before the whole reply was read: nothing of it was lost, and
    a later `PendingReply.read` goes on where this one stopped (the call itself goes on)."""


class LinkGone(TransportError):
    """The link was retired or closed before the call sent anything: it never reached the
    sidecar (the transport sends it on the link that replaced this one, if any)."""

    def __init__(self) -> None:
        super().__init__(Status.UNAVAILABLE, "the local link is closed")


def _wait_in_slices(sock: socket.socket, seconds: float, receives_only: bool = False) -> None:
    """Makes each send or receive on `sock` (a blocking one) wait at most `seconds`, then fail
    with EAGAIN (BlockingIOError). The kernel's limits (SO_RCVTIMEO, SO_SNDTIMEO), not
    Python's timeout: that one polls before every receive, a second system call each."""
    seconds = max(seconds, 0.001)  # 0 would mean no limit
    limit = struct.pack("ll", int(seconds), int(seconds % 1 * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
    if not receives_only:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)


class LinkClient:
    def __init__(self, path: str, token: str, lost: Callable[[], bool], poll: float):
        self.path = path
        self._token = token.encode()
        self._lost = lost
        self._poll = poll
        self._idle: list[socket.socket] = []  # open, and no call has them
        self._sockets: set[socket.socket] = set()  # open, idle or busy
        self._busy: set[socket.socket] = set()  # taken by a call (or the drain of one)
        self._lock = threading.Lock()  # guards the sets, and every close or shutdown
        self._closed = False  # retired or closed: no new call
        self._woken = False  # closed: calls in flight stop waiting
        self.hello_seconds = max(10.0, 10 * poll)  # a new socket's greeting, without a deadline
        self._forget(self._socket())  # fail now, not at the first call, if the link is unreachable

    def _socket(self, deadline: float | None = None) -> socket.socket:
        """An idle socket, taken for a call (busy until `_give_back` or `_forget`), or a new
        one (greeted with the token). Raises LinkGone once closed.

        Opening waits like a call does: in `poll` slices while the host is not lost, until
        `deadline` or, without one, `hello_seconds` (longer than the heartbeat takes to find
        a silent sidecar lost): a stopped sidecar is a lost host from a new socket too."""
        with self._lock:
            if self._closed:
                raise LinkGone()
            if self._idle:
                sock = self._idle.pop()
                self._busy.add(sock)
                return sock
        hello = time.monotonic() + self.hello_seconds
        deadline = hello if deadline is None else min(deadline, hello)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        frame = link.ReplyFrame()
        try:
            self._connect(sock, deadline)
            link.send_request(sock, link.HELLO, self._token)
            self._read_frame(sock, frame, deadline)
        except BaseException:
            sock.close()
            raise
        status, body = link.parse_reply(frame.body())
        if status != 0:
            sock.close()
            raise TransportError(Status.of(status), bytes(body).decode(errors="replace"))
        with self._lock:
            if self._closed:  # closed while we connected: close() did not see this socket
                sock.close()
                raise LinkGone()
            self._sockets.add(sock)
            self._busy.add(sock)
        return sock

    def _connect(self, sock: socket.socket, deadline: float) -> None:
        """Connects; a full backlog (a sidecar stopped, or slow to accept a burst of new
        threads) is waited out like a late reply, never taken for a broken link."""
        sock.settimeout(self._poll)
        while True:
            try:
                sock.connect(self.path)
                sock.settimeout(None)
                _wait_in_slices(sock, self._poll)
                return
            except BlockingIOError:  # EAGAIN: the listener's backlog is full
                pass
            if self._closed:
                raise LinkGone()
            if self._lost():
                raise TransportError(Status.UNAVAILABLE, "host lost waiting to connect")
            if time.monotonic() > deadline:
                raise TransportError(Status.DEADLINE_EXCEEDED, "no room to connect before the deadline")
            time.sleep(min(0.01, self._poll))

    def _forget(self, sock: socket.socket) -> None:
        """Closes a socket this thread took and will not use again."""
        with self._lock:
            self._busy.discard(sock)
            self._sockets.discard(sock)
            sock.close()

    def _give_back(self, sock: socket.socket) -> None:
        """Makes a socket whose call completed idle (closes it once closed)."""
        with self._lock:
            self._busy.discard(sock)
            if not self._closed:
                self._idle.append(sock)
                return
            self._sockets.discard(sock)
            sock.close()

    def send(
        self,
        method: str,
        message: bytes,
        reply_type: Any,
        timeout: float | None,
        abandoned: Callable[[Any], None] | None = None,
        unsent: Callable[[], None] | None = None,
    ) -> PendingReply:
        """Sends one request (`message`, serialized) on a socket taken for it; its reply is
        read by `PendingReply`.

        The socket goes back only once the whole reply was read: a call cut short by anything
        (an interrupt, any exception, its deadline) retires it, so no later call can read this
        call's reply. The reply is still read, in the background, and handed to `abandoned`
        (which frees what it carries), unless the link broke. `unsent` runs if the call fails
        before a byte of its request was sent: the sidecar never saw it.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        sock = None
        sending = False
        try:
            try:
                sock = self._socket(deadline)  # taken: back only after a complete reply
                frame = link.request_frame(method, message)
                sending = True
                self._send_frame(sock, frame, deadline)
            except (TimeoutError, BlockingIOError):  # not connected within a poll (a stopped sidecar)
                self._give_up(sock, None)
                raise TransportError(Status.DEADLINE_EXCEEDED, "no answer on the local link") from None
            except (OSError, link.LinkClosed) as e:
                self._give_up(sock, None)
                why = "was closed during the call" if self._woken else f"broke: {e}"  # woken: close()
                raise TransportError(Status.UNAVAILABLE, f"local link {why}") from None
            except TransportError:  # no socket (nothing taken), or the host lost or the deadline
                self._give_up(sock, None)  # passed mid-request: the sidecar never runs half of one
                raise
            except BaseException:  # an interrupt: the reply may still come (sendall checks for
                # signals after sending: an interrupted send may have sent it all)
                self._give_up(sock, (link.ReplyFrame(), reply_type, abandoned) if sending else None)
                raise
        except BaseException as e:
            if not sending and unsent is not None and not isinstance(e, LinkGone):
                unsent()
            raise
        return PendingReply(self, sock, reply_type, deadline, abandoned)

    def _send_frame(self, sock: socket.socket, frame: bytes, deadline: float | None) -> None:
        """Sends `frame` whole. A sidecar that stops reading for a while (its interpreter busy,
        its process stopped) fills the socket's buffer: the rest waits, as a reply does, while
        the host is alive and the deadline is ahead."""
        try:
            sent = sock.send(frame)  # the whole of a frame that fits the buffer: one system call
        except (TimeoutError, BlockingIOError):  # a slice passed with the buffer full
            sent = 0
        view = memoryview(frame)
        while sent < len(view):
            sent += self._patiently(sock, deadline, sock.send, view[sent:])

    def _give_up(self, sock: socket.socket | None, drain: tuple[link.ReplyFrame, Any, Any] | None) -> None:
        """Retires the socket of a call cut short; with `drain`, its reply is read first."""
        if sock is None:
            return
        if drain is None or drain[2] is None:
            self._forget(sock)
            return
        threading.Thread(
            target=self._drain, args=(sock, *drain), name="colocar-link-drain", daemon=True
        ).start()

    def _drain(self, sock: socket.socket, frame: link.ReplyFrame, reply_type: Any, abandoned: Any) -> None:
        """Background: reads the reply of an abandoned call and hands it over, then closes.

        Our end stops sending first: the sidecar answers a request it received whole, then
        sees the end of the stream and closes (a request cut short is never run). So the
        stream ends with this reply, and the bytes an interrupted `recv_into` put in the
        frame's buffer uncounted are the ones missing from what is left."""
        try:
            sock.shutdown(socket.SHUT_WR)
            while frame.buffer is None:
                self._peek_header(sock, frame, None)
            rest = bytearray()
            while chunk := self._patiently(sock, None, sock.recv, 1 << 20):
                rest += chunk
            uncounted = len(frame.buffer) - frame.taken - len(rest)
            if uncounted < 0:
                raise link.LinkClosed("the abandoned reply does not match its frame")
            frame.buffer[frame.taken + uncounted :] = rest
            status, body = link.parse_reply(frame.body())
            if status == 0:
                abandoned(reply_type.FromString(body))
        except Exception:  # noqa: BLE001 - a lost link: the session's lease frees what it held
            pass
        finally:
            self._forget(sock)

    def _read_frame(
        self, sock: socket.socket, frame: link.ReplyFrame, deadline: float | None, until: float | None = None
    ) -> None:
        """Reads the rest of `frame`, giving up when the host is lost or the deadline passed;
        NotYet once `until` (a wait's own limit) passed (within a slice, if a reply trickles)."""
        if until is not None:
            self._slices_until(sock, until)
        try:
            while frame.buffer is None:
                self._peek_header(sock, frame, deadline, until)
            view = memoryview(frame.buffer)
            while frame.taken < len(view):
                n = self._patiently(sock, deadline, sock.recv_into, view[frame.taken :], until=until)
                if not n:
                    raise link.LinkClosed("link closed by the sidecar")
                frame.taken += n
        finally:
            if until is not None and until - time.monotonic() < self._poll:  # (it may have shortened them)
                _wait_in_slices(sock, self._poll, receives_only=True)

    def _slices_until(self, sock: socket.socket, until: float) -> None:
        """Makes the socket's receive slices end at `until` when it comes sooner than a poll."""
        left = until - time.monotonic()
        if left < self._poll:
            _wait_in_slices(sock, max(left, 0.0), receives_only=True)

    def _peek_header(
        self, sock: socket.socket, frame: link.ReplyFrame, deadline: float | None, until: float | None = None
    ) -> None:
        """Opens the frame once its whole header is there (peeked: nothing is consumed)."""
        header = self._patiently(sock, deadline, sock.recv, 4, socket.MSG_PEEK, until=until)
        if not header:
            raise link.LinkClosed("link closed by the sidecar")
        if len(header) < 4:
            time.sleep(0.0005)  # the rest of the header is on its way
            return
        frame.open(header)

    def _patiently(
        self,
        sock: socket.socket,
        deadline: float | None,
        io: Callable[..., Any],
        *args: Any,
        until: float | None = None,
    ) -> Any:
        """io(*args) (a receive or send on `sock`), retried in `poll` slices while the host is
        alive and the deadline is ahead; NotYet once `until` passed (a slice that timed out
        consumed nothing)."""
        last_look = False
        while True:
            try:
                value = io(*args)
            except (TimeoutError, BlockingIOError):  # a slice passed (see `_wait_in_slices`)
                if until is not None and not last_look:
                    if time.monotonic() >= until:
                        raise NotYet from None
                    self._slices_until(sock, until)
                if last_look:
                    why = "the local link was closed" if self._woken else "host lost"
                    raise TransportError(Status.UNAVAILABLE, f"{why} waiting on the local link") from None
                if self._lost() or self._woken:
                    last_look = True  # the reply may have landed just before the sidecar went
                    _wait_in_slices(sock, 0.05)
                    continue
                if deadline is not None and time.monotonic() > deadline:
                    raise TransportError(Status.DEADLINE_EXCEEDED, "deadline exceeded") from None
                continue
            if last_look:
                _wait_in_slices(sock, self._poll)
            return value

    def retire(self) -> None:
        """No new call (they raise LinkGone); calls in flight finish on their sockets, which
        their threads close. Idle sockets are closed now."""
        self._shut(wake=False)

    def close(self) -> None:
        """As `retire`, and calls in flight stop waiting: they fail as UNAVAILABLE."""
        self._shut(wake=True)

    def _shut(self, wake: bool) -> None:
        with self._lock:  # no socket changes hands meanwhile (see `_socket`, `_give_back`)
            self._closed = True
            self._woken = self._woken or wake
            self._idle.clear()
            for sock in list(self._sockets):
                if sock not in self._busy:
                    self._sockets.discard(sock)
                    sock.close()
                elif wake:  # wakes its thread (a log poll's long wait); the thread closes it
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass


class PendingReply:
    """The reply of a request `send` sent, read once by whoever `claim`s it first: the thread
    that waits for it, or a thread that reads it for nobody in particular. A claim is never
    given up: the claimant reads (`read`) or retires the socket (`abandon`)."""

    __slots__ = ("_client", "_sock", "_reply_type", "_deadline", "_abandoned", "_claim", "_frame")

    def __init__(
        self,
        client: LinkClient,
        sock: socket.socket,
        reply_type: Any,
        deadline: float | None,
        abandoned: Callable[[Any], None] | None,
    ):
        self._client, self._sock, self._reply_type = client, sock, reply_type
        self._deadline, self._abandoned = deadline, abandoned
        self._claim = threading.Lock()
        self._frame = link.ReplyFrame()  # what was read of the reply (a read cut short by NotYet goes on)

    def claim(self) -> bool:
        """True for the first caller only: the reply is theirs to read or abandon."""
        return self._claim.acquire(blocking=False)

    def wait(self) -> Any:
        """The reply, read in this thread (a synchronous call: nobody else can claim it yet)."""
        self.claim()
        return self.read()

    def read(self, until: float | None = None) -> Any:
        """The reply (after `claim`); raises TransportError (the sidecar's status, or the
        link's failure). Cut short, the socket is retired: the reply is read in the background
        and handed to `abandoned`, unless the link broke. Past `until` (a monotonic time) it
        raises NotYet: the claimant reads on later, from where this read stopped."""
        client, sock, frame = self._client, self._sock, self._frame
        try:
            client._read_frame(sock, frame, self._deadline, until)
        except NotYet:
            raise
        except (OSError, link.LinkClosed) as e:
            client._give_up(sock, None)
            why = "was closed during the call" if client._woken else f"broke: {e}"  # woken: close()
            raise TransportError(Status.UNAVAILABLE, f"local link {why}") from None
        except TransportError as e:
            timed_out = e.status == Status.DEADLINE_EXCEEDED
            client._give_up(sock, (frame, self._reply_type, self._abandoned) if timed_out else None)
            raise
        except BaseException:  # an interrupt: the rest of the reply is drained
            client._give_up(sock, (frame, self._reply_type, self._abandoned))
            raise
        status, body = link.parse_reply(frame.body())
        if status == Status.UNAUTHENTICATED:  # the sidecar closes a connection it refused
            client._forget(sock)
        else:
            client._give_back(sock)
        if status != 0:
            raise TransportError(Status.of(status), bytes(body).decode(errors="replace"))
        return self._reply_type.FromString(body)

    def abandon(self) -> None:
        """(After `claim`) nobody will read the reply: it is drained in the background and
        handed to `abandoned`."""
        self._client._give_up(self._sock, (self._frame, self._reply_type, self._abandoned))
