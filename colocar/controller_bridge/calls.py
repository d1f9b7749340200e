"""One call of shipped code on one host: request building, code caching, futures, errors.

Runs in the controller. The code travels once per sidecar: calls carry its hash, and a
NOT_FOUND answer (new or restarted sidecar) makes the call go again with the code. Results are
decoded in the thread that asks for them, never in gRPC's callback threads.

A call its caller stops waiting for (an interrupt such as Ctrl-C, its timeout, `cancel()`) is
abandoned: it raises, its lane moves on, and the sidecar is told to cancel it (see
`HostConnection`); a later call never sees its reply. A generator's stream cut short by an
interrupt is closed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import grpc

from colocar.errors import ColocarError, RemoteError, RemoteTraceback
from colocar.protocol import colocar_pb2 as pb
from colocar.protocol import serialization

from .connection import HostConnection, LaneFuture

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


def _is_code_miss(e: grpc.RpcError) -> bool:
    return e.code() == grpc.StatusCode.NOT_FOUND and (e.details() or "").startswith("code:")


class Call:
    """A request to one host; `start()` sends it in program order, `result()` decodes."""

    def __init__(
        self,
        conn: HostConnection,
        request: pb.CallRequest,
        code: ShippedCode | None,
        timeout: float | None,
        keepalive: list[Any],
    ):
        self.conn = conn
        self.request = request
        self.code = code
        self.timeout = timeout
        self._keepalive = keepalive
        self._future: LaneFuture | None = None
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
        conn.check_alive()
        label = name or (code.name if code else method)
        payload, consumed, keepalive = conn.encode((args, kwargs), what=f"the arguments of {label}")
        request = pb.CallRequest(
            session_id=conn.session_id,
            kind=kind,
            args=payload,
            object_id=object_id,
            method=method,
            processes=processes,
            name=label,
            consume_blocks=consumed,
            object_name=object_name,
            object_ttl_seconds=object_ttl,
            call_id=conn.next_call_id(),
        )
        return cls(conn, request, code, timeout, keepalive)

    def _with_code(self, force: bool) -> pb.CallRequest:
        if self.code is None:
            return self.request
        code_hash, code = self.code.pickled()
        self.request.code_hash = code_hash
        self.request.code = code if force or code_hash not in self.conn.known_code else b""
        return self.request

    def _sent(self) -> None:
        if self.code is not None:
            self.conn.known_code.add(self.request.code_hash)

    def _call_sync(self) -> pb.CallReply:
        """The reply, resending the code if the sidecar does not know it; raises our errors.
        Cut short by its timeout or an interrupt, the call is cancelled on the sidecar."""
        conn = self.conn
        try:
            try:
                reply = conn.sync("Call", self._with_code(False), self.timeout)
            except grpc.RpcError as e:
                if not _is_code_miss(e):
                    raise
                reply = conn.sync("Call", self._with_code(True), self.timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                conn.cancel_soon(self.request.call_id)
            raise conn.translate(e, f"call of {self.request.name}") from None
        except BaseException as e:
            if not isinstance(e, Exception):  # an interrupt
                conn.cancel_soon(self.request.call_id)
            raise
        self._sent()
        return reply

    def run(self) -> Any:
        """Sends and waits; skips the ordering queue (and takes the local link when there is one)
        if this thread has nothing else in flight to the host."""
        if not self.conn.lane_idle():
            return self.start().result()
        try:
            self._reply = self._call_sync()
        finally:
            self._keepalive = []
        return self.result()

    def start(self) -> CallFuture:
        """Queues the call behind this thread's earlier calls to the host; returns its future.

        With a local link the call runs on one of the connection's link threads; otherwise it
        is an asynchronous gRPC call.
        """
        conn = self.conn

        def send() -> Future:
            if conn.link is not None:
                return conn.link_executor().submit(self._call_sync)
            outer: Future = Future()

            def attempt(force: bool) -> None:
                rpc = conn.stub.Call.future(
                    self._with_code(force), metadata=conn.metadata, timeout=self.timeout
                )

                def done(f: Any) -> None:
                    try:
                        reply = f.result()
                    except grpc.RpcError as e:
                        if not force and _is_code_miss(e):
                            attempt(True)
                            return
                        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                            conn.cancel_soon(self.request.call_id)
                        outer.set_exception(conn.translate(e, f"call of {self.request.name}"))
                        return
                    except BaseException as e:  # cancelled
                        outer.set_exception(e)
                        return
                    self._sent()
                    outer.set_result(reply)

                rpc.add_done_callback(done)

            attempt(False)
            return outer

        self._future = conn.submit(send, unsent=self._unsent)
        self._future.add_done_callback(self._release_keepalive)  # blocks held for the call only
        return CallFuture(self)

    def _release_keepalive(self, _: Future) -> None:
        self._keepalive = []

    def _unsent(self) -> None:
        """Cancelled before it was sent: the blocks allocated for its arguments go back."""
        self.conn.release_soon(self.request.consume_blocks)

    def abandon(self) -> bool:
        """Gives up on a started call (see the module docstring); False if it had completed."""
        future = self._future
        if future is None or not future.abandon():
            return False
        if not future.cancelled():  # it was sent (not cancelled while queued): the sidecar may run it
            self.conn.cancel_soon(self.request.call_id)
        return True

    def result(self, timeout: float | None = None) -> Any:
        if self._reply is None:
            assert self._future is not None
            self._reply = self._future.result(timeout)
            self._keepalive = []
        reply = self._reply
        if reply is _TAKEN:
            raise ColocarError(
                f"the result of {self.request.name} was lost: an interrupt came while it was decoded"
            )
        if reply.HasField("error"):
            raise rebuild_exception(reply.error, self.conn.name)
        if self.request.kind == pb.CallRequest.NEW_OBJECT:
            return reply.object_id
        self._reply = _TAKEN  # its blocks become views now: decoding twice could read freed ones
        return self.conn.decode(reply.result)


class CallFuture:
    """The future of one host call (concurrent.futures-like: result, exception, done, cancel)."""

    def __init__(self, call: Call):
        self._call = call
        self._value: Any = None
        self._decoded = False
        self._lock = threading.Lock()

    @property
    def host(self) -> str:
        return self._call.conn.name

    def result(self, timeout: float | None = None) -> Any:
        """The call's value; an interrupt while waiting abandons the call (see `cancel`)."""
        with self._lock:
            if not self._decoded:
                try:
                    self._value = self._call.result(timeout)
                except BaseException as e:
                    if not isinstance(e, Exception):
                        self._call.abandon()
                    raise
                self._decoded = True
            return self._value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            self.result(timeout)
        except BaseException as e:  # noqa: BLE001
            return e
        return None

    def done(self) -> bool:
        f = self._call._future
        return f is None or f.done()

    def cancel(self) -> bool:
        """Cancels the call, even a running one: it raises CancelledError, the next call on its
        lane goes at once, and the sidecar stops it (a worker process) or lets it run out
        unobserved (a thread). False if it had completed."""
        return self._call.abandon()

    def add_done_callback(self, fn: Callable[[CallFuture], None]) -> None:
        f = self._call._future
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


class RemoteIterator:
    """Items of a remote generator, streamed with flow control (at most `prefetch` in flight)."""

    def __init__(
        self, conn: HostConnection, request: pb.CallRequest, code: ShippedCode | None, prefetch: int = 2
    ):
        import queue

        self._conn = conn
        if code is not None:  # a function (a method needs no code: its object is there)
            request.code_hash, request.code = code.pickled()
        self._requests: queue.Queue = queue.Queue()
        self._requests.put(pb.StreamRequest(call=request, credits=max(1, prefetch)))
        self._responses = conn.stub.Stream(iter(self._requests.get, None), metadata=conn.metadata)
        self._name = request.name
        self._closed = False
        self._finished = False  # the server sent `done` or an error
        self._interrupted = False

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        """The next item; an interrupt closes the stream in the background (an item may have
        been in hand, and its credit not yet given back), so later calls raise."""
        if self._interrupted:
            raise ColocarError(
                f"the stream of {self._name} on {self._conn.name} was closed by an interrupt; "
                "call the generator again for a new one"
            )
        if self._closed:
            raise StopIteration
        try:
            return self._next()
        except BaseException as e:
            if not isinstance(e, Exception) and not self._closed:
                self._interrupted = True
                threading.Thread(target=self.close, name="colocar-stream-close", daemon=True).start()
            raise

    def _next(self) -> Any:
        try:
            reply = next(self._responses)
        except StopIteration:
            self._finished = True
            self.close()
            raise ColocarError(f"stream of {self._name} on {self._conn.name} ended early") from None
        except grpc.RpcError as e:
            self._finished = True
            self.close()
            raise self._conn.translate(e, f"stream of {self._name}") from None
        if reply.HasField("error") or reply.done:
            self._finished = True
            self.close()
            if reply.HasField("error"):
                raise rebuild_exception(reply.error, self._conn.name)
            raise StopIteration
        self._requests.put(pb.StreamRequest(credits=1))
        return self._conn.decode(reply.result)

    def close(self, timeout: float = 10.0) -> None:
        """Stops the remote generator (it is closed on the sidecar).

        Items already on their way are received and dropped, so the arena blocks they carry
        are released now rather than when the session ends.
        """
        if self._closed:
            return
        self._closed = True
        if not self._finished:
            self._requests.put(pb.StreamRequest(stop=True))
            timer = threading.Timer(timeout, self._responses.cancel)
            timer.start()
            try:
                for reply in self._responses:
                    if reply.done or reply.HasField("error"):
                        break
                    self._conn.decode(reply.result)  # dropped at once: its blocks go back
            except (grpc.RpcError, ColocarError):
                pass
            finally:
                timer.cancel()
        self._requests.put(None)
        self._responses.cancel()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):  # dropped without close(): cancel, do not block
            self._closed = True
            self._requests.put(None)
            self._responses.cancel()
