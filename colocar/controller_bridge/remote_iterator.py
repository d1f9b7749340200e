"""A remote generator's items, streamed to the controller with flow control.

Runs in the controller. `Stream` is the one call that is not unary: it goes over gRPC even when
the local link is there. A thread reads the stream into a queue, so that an interrupt never
cuts a gRPC read short; a stream closed early (by `close()`, an interrupt or a dropped
iterator) still receives and drops the items on their way, so their blocks go back at once.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

from colocar.errors import ColocarError
from colocar.protocol import colocar_pb2 as pb

from .calls import ShippedCode, rebuild_exception
from .connection import HostConnection
from .sigint import sigint_held


class RemoteIterator:
    """Items of a remote generator, streamed with flow control (at most `prefetch` in flight).

    A thread of its own reads the gRPC stream into a queue: a gRPC read cut short by an
    interrupt breaks the stream for good, a wait on a queue does not. An interrupt while the
    program takes an item still closes the stream (the item may have been in hand, its credit
    not yet given back), in the background, and later `next()` calls say so.
    """

    def __init__(
        self, conn: HostConnection, request: pb.CallRequest, code: ShippedCode | None, prefetch: int = 2
    ):
        self._conn = conn
        try:
            if code is not None:  # a function (a method needs no code: its object is there)
                request.code_hash, request.code = code.pickled()
            self._requests: queue.Queue = queue.Queue()
            self._requests.put(pb.StreamRequest(call=request, credits=max(1, prefetch)))
        except BaseException:  # never sent: the blocks of its arguments go back
            conn.releases.release_soon(request.consume_blocks)
            raise
        # A Ctrl-C from here on lands once the iterator is whole: dropped, it stops its stream
        with sigint_held():
            self._responses = conn.grpc.stream("Stream", iter(self._requests.get, None))
            self._replies: queue.SimpleQueue = queue.SimpleQueue()
            # the reader holds no reference to self, so that a dropped iterator is collected
            threading.Thread(
                target=_read_stream, args=(self._responses, self._replies), name="colocar-stream", daemon=True
            ).start()
            self._name = request.name
            self._closed = False
            self._finished = False  # the server sent `done` or an error
            self._interrupted = False
            self._in_hand: Any = None  # a reply taken from the queue and not yet decoded

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._interrupted:
            raise ColocarError(
                f"the stream of {self._name} on {self._conn.session.name} was closed by an interrupt; "
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
        reply = self._in_hand = self._replies.get()  # an interrupt from here on: close() frees it
        if not isinstance(reply, pb.CallReply):
            self._finished = True
            self.close()
            if reply is None:
                raise ColocarError(f"stream of {self._name} on {self._conn.session.name} ended early")
            raise self._conn.translate(reply, f"stream of {self._name}")
        if reply.HasField("error") or reply.done:
            self._finished = True
            self.close()
            if reply.HasField("error"):
                raise rebuild_exception(reply.error, self._conn.session.name)
            raise StopIteration
        self._requests.put(pb.StreamRequest(credits=1))
        self._in_hand = None  # from here on its views own its blocks
        return self._conn.blocks.decode(reply.result)

    def close(self, timeout: float = 10.0) -> None:
        """Stops the remote generator (it is closed on the sidecar).

        Items already on their way are received and dropped, so the arena blocks they carry
        are released now rather than when the session ends.
        """
        if self._closed:
            return
        self._closed = True
        held, self._in_hand = self._in_hand, None
        if isinstance(held, pb.CallReply):  # an interrupt came as it was taken
            self._conn.releases.discard_reply(held)
        _stop_stream(self._conn, self._requests, self._replies, self._responses, timeout, self._finished)

    def __del__(self) -> None:
        if sys.is_finalizing():  # no thread starts now; the session's end stops the stream
            return
        if not getattr(self, "_closed", True):  # dropped without close(): stop it, do not block
            self._closed = True
            args = (self._conn, self._requests, self._replies, self._responses, 10.0, self._finished)
            try:
                threading.Thread(
                    target=_stop_stream, args=args, name="colocar-stream-close", daemon=True
                ).start()
            except (RuntimeError, AttributeError, TypeError):  # the interpreter is exiting
                with contextlib.suppress(Exception):  # no thread, no draining: cancel it if gRPC still can
                    self._responses.cancel()


def _stop_stream(
    conn: HostConnection,
    requests: queue.Queue,
    replies: queue.SimpleQueue,
    responses: Any,
    timeout: float,
    finished: bool,
) -> None:
    """Asks the sidecar to end a stream, and receives and drops the items already on their way
    (their blocks go back now, not when the session ends); cancels it after `timeout` s."""
    if not finished:
        requests.put(pb.StreamRequest(stop=True))
        deadline = time.monotonic() + timeout
        while True:
            try:
                reply = replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if not isinstance(reply, pb.CallReply) or reply.done or reply.HasField("error"):
                break
            with contextlib.suppress(ColocarError):
                conn.blocks.decode(reply.result)
    requests.put(None)
    responses.cancel()


def _read_stream(responses: Any, replies: queue.SimpleQueue) -> None:
    """Background: the stream's replies into `replies`, then None (ended) or the RpcError."""
    try:
        for reply in responses:
            replies.put(reply)
    except grpc.RpcError as e:
        replies.put(e)
        return
    replies.put(None)
