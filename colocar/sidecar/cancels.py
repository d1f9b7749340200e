"""Calls whose controller gave up on them (an interrupt, a timeout, `future.cancel()`).

The controller names each call with an id unique in its session and, when it stops waiting,
sends `Cancel` with that id. The call's token is then set: a call running in a worker process
is stopped (`WorkerPool` watches the token of the call it serves, found through `current()`);
a call running in a thread cannot be stopped, so it is counted as abandoned until it ends. Its
reply is replaced by an error and its result's blocks are freed: nobody will read them. A Cancel
that arrives before its call (the two travel on different connections) is remembered, and the
call never runs.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable
from typing import Any

from colocar.protocol import colocar_pb2 as pb
from colocar.shm import UnknownBlockError

from .func_backend import remote_error

EARLY_CANCELS = 4096  # cancels remembered for calls not seen yet, oldest forgotten first


class CallCancelledError(RuntimeError):
    """The reply of a call its controller cancelled (nobody reads it; it only frees the call)."""


class CancelToken:
    """Set once the call's controller cancelled it (a plain flag: a call pays for no Event)."""

    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False


_current: contextvars.ContextVar[CancelToken | None] = contextvars.ContextVar("colocar_cancel", default=None)


def current() -> CancelToken | None:
    """The token of the call this thread serves (None outside a tracked call)."""
    return _current.get()


class CallRegistry:
    """The running calls by (session, call id), the early cancels, and the abandoned count."""

    def __init__(self) -> None:
        self._running: dict[tuple[str, int], CancelToken] = {}
        self._early: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
        self._abandoned = 0
        self._lock = threading.Lock()

    def begin(self, key: tuple[str, int]) -> CancelToken:
        """Registers call `key` (session id, call id) while it runs, until `end`; its token is
        already set if it was cancelled early."""
        token = CancelToken()
        with self._lock:
            if key[1] and self._early.pop(key, 0) is None:
                token.cancelled = True
            elif key[1]:
                self._running[key] = token
        return token

    def end(self, key: tuple[str, int], token: CancelToken) -> None:
        with self._lock:
            if self._running.get(key) is token:
                del self._running[key]
                if token.cancelled:
                    self._abandoned -= 1

    def cancel(self, session_id: str, call_ids: list[int]) -> None:
        with self._lock:
            for call_id in call_ids:
                key = (session_id, call_id)
                token = self._running.get(key)
                if token is None:
                    self._early[key] = None
                    while len(self._early) > EARLY_CANCELS:
                        self._early.popitem(last=False)
                elif not token.cancelled:
                    token.cancelled = True
                    self._abandoned += 1

    def abandoned(self) -> int:
        """Cancelled calls still running (threads, which cannot be stopped)."""
        return self._abandoned


def cancellable(handler: Callable[[Any, pb.CallRequest], pb.CallReply]) -> Callable[..., pb.CallReply]:
    """Wraps the servicer's `Call`: tracks the call by its id, and answers a cancelled one with
    an error, freeing its result (blocks, a new object) or, cancelled before it ran, its input blocks."""

    @functools.wraps(handler)
    def call(service: Any, request: pb.CallRequest) -> pb.CallReply:
        registry, key = service.cancels, (request.session_id, request.call_id)
        token = registry.begin(key)
        reset = _current.set(token)
        try:
            if token.cancelled:  # cancelled before it arrived: it never runs
                service.session(request.session_id)  # the session check first
                _release(service, request.session_id, request.consume_blocks)
                return _cancelled(request)
            reply = handler(service, request)
        finally:
            _current.reset(reset)
            registry.end(key, token)
        if token.cancelled:
            _release(service, request.session_id, [b.id for b in reply.result.blocks])
            if reply.object_id:
                service.objects.delete(reply.object_id, request.session_id)
            return _cancelled(request)
        return reply

    return call


def _cancelled(request: pb.CallRequest) -> pb.CallReply:
    error = CallCancelledError(f"{request.name} was cancelled by its caller")
    return pb.CallReply(error=remote_error(error))


def _release(service: Any, session_id: str, block_ids: Any) -> None:
    for block_id in block_ids:
        with contextlib.suppress(UnknownBlockError):
            service.arena.allocator.release(block_id, session_id)
