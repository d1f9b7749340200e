"""One call of shipped code on one host: request building, code caching, futures, errors.

Runs in the controller. The code travels once per sidecar: calls carry its hash, and a
NOT_FOUND answer (new or restarted sidecar) makes the call go again with the code. Results are
decoded in the thread that asks for them, never in gRPC's callback threads.

A call its caller stops waiting for (an interrupt such as Ctrl-C, its timeout, `cancel()`) is
abandoned: it raises, its lane moves on, and the sidecar is told to cancel it (see
`HostConnection`); a later call never sees its reply. Generators stream through
`remote_iterator.py`.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from colocar.errors import ColocarError, RemoteError, RemoteTraceback
from colocar.protocol import colocar_pb2 as pb
from colocar.protocol import serialization
from colocar.protocol.status import Status, TransportError

from .connection import HostConnection
from .lanes import LaneFuture

_TAKEN = pb.CallReply()  # a reply being decoded, or decoded: it is never decoded twice


class ShippedCode:
    """A function or class pickled once (lazily) and identified by its hash."""

    def __init__(self, target: Any, ship_modules: tuple[Any, ...] = ()):
        self.target = target
        self.ship_modules = ship_modules
        self.name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', target)}"
        self._code: bytes | None = None
        self._hash = b""
        self._lock = threading.Lock()

    def pickled(self) -> tuple[bytes, bytes]:
        with self._lock:
            if self._code is None:
                self._code = serialization.dumps_code(self.target, self.ship_modules)
                self._hash = serialization.code_hash(self._code)
            return self._hash, self._code


def _is_code_miss(e: TransportError) -> bool:
    return e.status == Status.NOT_FOUND and e.details.startswith("code:")


class Call:
    """A request to one host; `start()` sends it in program order, `result()` decodes."""

    def __init__(
        self,
        conn: HostConnection,
        request: pb.CallRequest,
        code: ShippedCode | None,
        timeout: float | None,
        keepalive: list[Any],
        consumed: list[int],
    ):
        self.conn = conn
        self.request = request
        self.code = code
        self.timeout = timeout
        self._keepalive = keepalive
        self._future: LaneFuture | None = None
        self._consumed = consumed  # the blocks the request consumes: ours to free until it is sent
        self._claim_lock = threading.Lock()
        self._reply: pb.CallReply | None = None

    @classmethod
    def build(
        cls,
        conn: HostConnection,
        kind: pb.CallRequest.Kind,
        args: tuple,
        kwargs: dict,
        *,
        code: ShippedCode | None = None,
        object_id: int = 0,
        method: str = "",
        name: str = "",
        processes: bool = False,
        timeout: float | None = None,
        object_name: str = "",
        object_ttl: float = 0.0,
    ) -> Call:
        conn.session.check_alive()
        label = name or (code.name if code else method)
        session = conn.session
        request = pb.CallRequest(
            session_id=session.session_id, kind=kind, name=label, call_id=session.next_call_id()
        )
        consumed, keepalive = conn.blocks.encode((args, kwargs), f"the arguments of {label}", request.args)
        try:
            if object_id or method or processes or consumed or object_name or object_ttl:  # a
                request.object_id, request.method = object_id, method  # plain call sets none
                request.processes, request.object_name = processes, object_name
                request.object_ttl_seconds = object_ttl
                request.consume_blocks.extend(consumed)
            return cls(conn, request, code, timeout, keepalive, consumed)
        except BaseException:  # interrupted: no call will consume the blocks
            conn.releases.release_soon(consumed)
            raise

    def _with_code(self, force: bool) -> pb.CallRequest:
        """The request, with the code unless the sidecar has it; a failure (an unpicklable
        function, an interrupt) means the call is never sent."""
        if self.code is None:
            return self.request
        try:
            code_hash, code = self.code.pickled()
        except BaseException:
            self._unsent()
            raise
        self.request.code_hash = code_hash
        self.request.code = code if force or code_hash not in self.conn.session.known_code else b""
        return self.request

    def _sent(self) -> None:
        if self.code is not None:
            self.conn.session.known_code.add(self.request.code_hash)

    def _call_sync(self) -> pb.CallReply:
        """The reply (see `_after_failure` for a failed attempt); raises our errors. Cut short
        by an interrupt, the call is cancelled on the sidecar."""
        request, force = self._with_code(False), False
        while True:
            try:
                try:
                    reply = self.conn.transport.call("Call", request, self.timeout, self._unsent)
                    break
                except TransportError as e:
                    error = e
                request, force = self._after_failure(error, force), True
            except BaseException as e:
                if not isinstance(e, Exception):  # an interrupt
                    self.conn.releases.cancel_soon(self.request.call_id)
                raise
        self._sent()
        return reply

    def _call_async(self, future: LaneFuture) -> None:
        """Starts the call; it ends in `future.finish` (see `_after_failure`)."""
        self._send_async(self._with_code(False), False, future)

    def _send_async(self, request: pb.CallRequest, force: bool, future: LaneFuture) -> None:
        def finished(reply: Any, error: BaseException | None) -> None:
            if error is None:
                self._sent()
                future.finish(reply, None)
                return
            try:
                self._send_async(self._after_failure(error, force), True, future)
            except BaseException as e:
                future.finish(None, e)

        future.read_by(self.conn.transport.call_async("Call", request, self.timeout, finished, self._unsent))

    def _after_failure(self, error: BaseException, force: bool) -> pb.CallRequest:
        """After a failed attempt (of `_call_sync` or `_send_async`): the request again, with
        the code, if the sidecar lacked it (new or restarted) and it was not sent with the code
        already; else raises the error the caller sees (a call that timed out is cancelled on
        the sidecar)."""
        if not force and isinstance(error, TransportError) and _is_code_miss(error):
            return self._with_code(True)
        raise self._failed(error)

    def _failed(self, error: BaseException) -> BaseException:
        if not isinstance(error, TransportError):
            return error  # cancelled
        if error.status == Status.DEADLINE_EXCEEDED:
            self.conn.releases.cancel_soon(self.request.call_id)
        return self.conn.translate(error, f"call of {self.request.name}")

    def run(self) -> Any:
        """Sends and waits; skips the ordering queue (and takes the local link when there is one)
        if this thread has nothing else in flight to the host."""
        if not self.conn.lanes.idle():
            return self.start().result()
        try:
            self._reply = self._call_sync()
            return self.result()
        except BaseException as e:
            if not isinstance(e, Exception):
                self.drop_reply()
            raise
        finally:
            self._keepalive = []

    def start(self) -> CallFuture:
        """Queues the call behind this thread's earlier calls to the host; returns its future.

        With a local link the reply is read by the thread that waits for it (see `lanes`);
        otherwise it is an asynchronous gRPC call.
        """
        conn = self.conn
        try:
            self._future = conn.lanes.submit(self._call_async, unsent=self._unsent)
        except BaseException as e:
            if not isinstance(e, Exception):  # an interrupt as it was sent: the sidecar may run it
                conn.releases.cancel_soon(self.request.call_id)
            raise
        if self._keepalive:  # blocks held for the call only
            self._future.add_done_callback(self._release_keepalive)
        return CallFuture(self)

    def discard(self) -> None:
        """A call that will never be started: the blocks allocated for its arguments go back."""
        self._unsent()
        self._keepalive = []

    def _release_keepalive(self, _: LaneFuture) -> None:
        self._keepalive = []

    def _unsent(self) -> None:
        """Never sent (cancelled while queued, interrupted or failed before its request left):
        the blocks allocated for its arguments go back, once."""
        blocks, self._consumed = self._consumed, []
        self.conn.releases.release_soon(blocks)

    def abandon(self) -> bool:
        """Gives up on a started call (see the module docstring); False if it had completed."""
        future = self._future
        if future is None or not future.abandon():
            return False
        if not future.cancelled():  # it was sent (not cancelled while queued): the sidecar may run it
            self.conn.releases.cancel_soon(self.request.call_id)
        return True

    def drop_reply(self) -> None:
        """After an interrupt while the completed call's result was taken: frees the reply's
        blocks unless its decoding began (then its views own them)."""
        future = self._future
        with self._claim_lock:
            reply = self._reply
            if reply is None and future is not None and future.done() and not future.cancelled():
                reply = future.result() if future.exception() is None else None
            if reply is None or reply is _TAKEN:
                return
            self._reply = _TAKEN
        self.conn.releases.discard_reply(reply)

    def drop_when_unread(self) -> None:
        """Its future was dropped unread: the reply is freed now, or as soon as it comes
        (nothing can read it any more; its blocks would stay leased until the session ends)."""
        future = self._future
        if future is not None:
            future.add_done_callback(lambda _: self.drop_reply())
            future.detach()

    def result(self, timeout: float | None = None) -> Any:
        if self._reply is None:
            future = self._future
            assert future is not None
            until = None if timeout is None else time.monotonic() + timeout
            future.wait_inline(until)  # the rest of a reply late for `until` is read in the background
            reply = future.result(None if until is None else max(0.0, until - time.monotonic()))
            with self._claim_lock:
                if self._reply is None:
                    self._reply = reply
            self._keepalive = []
        reply = self._reply
        if reply is not _TAKEN and reply.HasField("error"):
            raise rebuild_exception(reply.error, self.conn.session.name)
        if reply is not _TAKEN and self.request.kind == pb.CallRequest.NEW_OBJECT:
            return reply.object_id
        with self._claim_lock:  # decoded once, or dropped: never both (a block released twice
            reply, self._reply = self._reply, _TAKEN  # could free memory that a view still reads)
        if reply is _TAKEN:
            raise ColocarError(
                f"the result of {self.request.name} was dropped: an interrupt came as it arrived"
            )
        return self.conn.blocks.decode(reply.result)


class CallFuture:
    """The future of one host call (concurrent.futures-like: result, exception, done, cancel)."""

    def __init__(self, call: Call):
        self._call = call
        self._value: Any = None
        self._decoded = False
        self._lock = threading.Lock()

    @property
    def host(self) -> str:
        return self._call.conn.session.name

    def result(self, timeout: float | None = None) -> Any:
        """The call's value; an interrupt while waiting abandons the call (see `cancel`)."""
        with self._lock:
            if not self._decoded:
                try:
                    self._value = self._call.result(timeout)
                except BaseException as e:
                    if not isinstance(e, Exception):
                        self.give_up()
                    raise
                self._decoded = True
            return self._value

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        # Dropped unread: nobody can take the reply any more. At exit there is nothing to free
        # (the session ends), and the modules it would need may be torn down already.
        if not self._decoded and not _finalizing():
            self._call.drop_when_unread()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            self.result(timeout)
        except BaseException as e:  # noqa: BLE001
            return e
        return None

    def _watched(self) -> LaneFuture | None:
        """The call's lane future, its reply read in the background: it completes unwaited."""
        f = self._call._future
        if f is not None:
            f.detach()
        return f

    def done(self) -> bool:
        f = self._watched()
        return f is None or f.done()

    def failure(self) -> BaseException | None:
        """Without waiting: the error the call ended with before any reply came (a lost host,
        its timeout, abandoned), else None (running, or a reply came: even one of an error)."""
        f = self._watched()
        if f is None or not f.done() or f.cancelled():
            return None
        return f.exception()

    def cancel(self) -> bool:
        """Cancels the call, even a running one: it raises CancelledError, the next call on its
        lane goes at once, and the sidecar stops it (a worker process) or lets it run out
        unobserved (a thread). False if it had completed."""
        return self._call.abandon()

    def give_up(self) -> None:
        """After an interrupt: cancels the call, or frees its reply if it had come (nobody will
        read it); a later `result()` raises."""
        if not self._call.abandon():
            self._call.drop_reply()

    def add_done_callback(self, fn: Callable[[CallFuture], None]) -> None:
        f = self._watched()
        if f is None:
            fn(self)
        else:
            f.add_done_callback(lambda _: fn(self))


def rebuild_exception(error: pb.RemoteError, host: str) -> BaseException:
    """The remote exception as its own type when possible, with the remote traceback attached."""
    exc: BaseException | None = None
    if error.exception:
        try:
            exc = serialization.loads(error.exception)
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        exc = RemoteError(error.type, error.message, host, error.traceback)
    exc.__cause__ = RemoteTraceback(f"\n\nRemote traceback (on {host}):\n{error.traceback}")
    try:
        exc.add_note(f"raised on colocar host {host}")
        exc.colocar_host = host  # type: ignore[attr-defined]
    except AttributeError:
        pass
    return exc
