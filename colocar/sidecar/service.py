"""The sidecar's service: sessions, calls, objects, streams, blocks, logs and stats.

The handlers serve both gRPC (through `grpc_servicer`, which checks the token first, constant
time, before any unpickling) and the local link (whose connections proved the token at hello).
Each checks the session. User errors travel back inside the reply (`CallReply.error`); a
handler raises `Refused` for protocol conditions the controller acts on: NOT_FOUND (unknown
code hash: resend the code), FAILED_PRECONDITION (unknown session or version skew), ABORTED
(a session taken over by another controller, or closed from outside),
INVALID_ARGUMENT (a malformed request or a descriptor outside the session's blocks),
RESOURCE_EXHAUSTED (a full arena pool), UNAVAILABLE (draining).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from colocar.protocol import colocar_pb2 as pb
from colocar.protocol.status import Refused, Status
from colocar.shm import ArenaFullError, UnknownBlockError

from . import logs
from .blocks import BoundsError, SidecarArena
from .cancels import CallRegistry, cancellable
from .func_backend import CodeCache, CodeLoadError, CodeNotFound, remote_error
from .held_blocks import HeldBlocks
from .objects import ObjectTable, UnknownObjectError
from .quotas import Quotas
from .session_service import SessionHandlers
from .sessions import Session, SessionTable
from .stats import Stats
from .streams import Credits, chain
from .workers import WorkerDiedError, WorkerPool

CHUNK_BYTES = 1 << 20
LOG_POLL_LINES = 1000  # lines per PollLogs reply at most


@dataclass
class ServiceConfig:
    lease_seconds: float = 30.0
    max_concurrent_calls: int = 32
    alloc_timeout_seconds: float = 30.0
    session_grace_seconds: float = 3600.0  # how long a named session outlives its controller
    quotas: Quotas = field(default_factory=Quotas)  # the tenant's, in a shared pool


class SidecarService(SessionHandlers):
    """The handlers: unary ones take the request; streaming ones also the gRPC context. The
    session handlers, and the session check every handler makes, are in `session_service`."""

    def __init__(self, arena: SidecarArena, workers: WorkerPool | None, config: ServiceConfig):
        self.id = uuid.uuid4().hex
        self.arena = arena
        self.workers = workers
        self.config = config
        self.quotas = config.quotas
        self.connect_lock = threading.Lock()
        self.stats = Stats()
        self.objects = ObjectTable()
        self.code = CodeCache()
        self.cancels = CallRegistry()
        self.held = HeldBlocks(arena.allocator, arena.arena.path)
        self.sessions = SessionTable(config.lease_seconds, self._session_ended, config.session_grace_seconds)
        # Tokens of a SimpleQueue bound concurrent calls (cheaper than a Semaphore per call).
        self._call_slots: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(config.max_concurrent_calls):
            self._call_slots.put(None)
        self._sweeper_stop = threading.Event()
        threading.Thread(target=self._sweep, name="colocar-sweeper", daemon=True).start()
        self.draining = False
        self.link_path = ""  # set by the server when the local link listens

    def _sweep(self) -> None:
        while not self._sweeper_stop.wait(1.0):
            self.objects.sweep()
            self.held.sweep()

    # --- calls -----------------------------------------------------------------------------
    @cancellable
    def Call(self, request: pb.CallRequest) -> pb.CallReply:
        session = self.session(request.session_id)
        started = self.stats.begin()
        reply = None
        try:
            with self.quotas.call():
                reply = self._run_in_slot(session, request)
            return reply
        finally:
            self.stats.end(started, failed=reply is None or reply.HasField("error"))

    def _run_in_slot(self, session: Session, request: pb.CallRequest) -> pb.CallReply:
        self._call_slots.get()
        try:
            return self._run(session, request)
        finally:
            self._call_slots.put(None)

    def Cancel(self, request: pb.CancelRequest) -> pb.Empty:
        """Stops the named calls of the session (see `cancels`)."""
        session = self.session(request.session_id)
        self.cancels.cancel(session.id, list(request.call_ids))
        return pb.Empty()

    def _target(self, session: Session, request: pb.CallRequest) -> Any:
        """The function, class or bound method a request names."""
        if request.kind == pb.CallRequest.METHOD:
            try:
                return getattr(self.objects.get(request.object_id, session.id), request.method)
            except UnknownObjectError as e:
                raise Refused(Status.NOT_FOUND, f"object: {e.args[0]}") from None
        try:
            return self.code.get(request.code_hash, request.code, request.name)
        except CodeNotFound:
            raise Refused(Status.NOT_FOUND, f"code: {request.name}") from None

    def _decode_args(self, session: Session, request: pb.CallRequest) -> Any:
        try:
            args, kwargs = self.arena.decode(request.args, session.id)
            return args, kwargs
        except BoundsError as e:
            raise Refused(Status.INVALID_ARGUMENT, str(e)) from None
        except Exception as e:  # a malformed pickle, or a class this sidecar cannot import
            raise Refused(
                Status.INVALID_ARGUMENT,
                f"cannot unpickle the arguments of {request.name} here: {type(e).__name__}: {e}",
            ) from None
        finally:
            if request.consume_blocks:
                self._release(session, request.consume_blocks)

    def _run(self, session: Session, request: pb.CallRequest) -> pb.CallReply:
        try:
            target = self._target(session, request)
        except CodeLoadError as e:
            return pb.CallReply(error=remote_error(e))
        if request.processes and request.kind == pb.CallRequest.FUNCTION and self.workers is not None:
            try:
                return self.workers.run(session.id, request, session.log, self.config.alloc_timeout_seconds)
            except BoundsError as e:
                raise Refused(Status.INVALID_ARGUMENT, str(e)) from None
            except CodeNotFound:  # the worker pool forgot the code's bytes: the controller resends
                raise Refused(Status.NOT_FOUND, f"code: {request.name}") from None
            except WorkerDiedError as e:
                return pb.CallReply(error=remote_error(e))
        args, kwargs = self._decode_args(session, request)
        try:
            with logs.routed_to(session.log):
                value = target(*args, **kwargs)
            del args, kwargs
            if request.kind == pb.CallRequest.NEW_OBJECT:
                object_id = self.objects.add(
                    value, session.id, request.object_name, request.object_ttl_seconds, session.name
                )
                return pb.CallReply(object_id=object_id)
            timeout, reply = self.config.alloc_timeout_seconds, pb.CallReply()
            encoded = self.arena.encode(value, session.id, f"result of {request.name}", timeout, reply.result)
            del value  # what still reaches a shared block now is the sidecar's: see hand_over
            self.arena.hand_over(encoded, session.id, timeout)  # in place, in reply.result
            return reply
        except Exception as e:  # noqa: BLE001 - the caller gets it, with its traceback
            return pb.CallReply(error=remote_error(e))

    def Stream(self, request_iterator: Iterator[pb.StreamRequest], context: Any) -> Iterator[pb.CallReply]:
        """A generator's items, at most as many ahead as the controller gave credits for."""
        first = next(request_iterator, None)
        if first is None or not first.HasField("call"):
            raise Refused(Status.INVALID_ARGUMENT, "Stream starts with a call")
        request = first.call
        session = self.session(request.session_id)
        with self.quotas.call():
            yield from self._stream(session, request, Credits(first.credits, request_iterator), context)

    def _stream(
        self, session: Session, request: pb.CallRequest, credits: Credits, context: Any
    ) -> Iterator[pb.CallReply]:
        context.add_callback(credits.end)
        try:
            target = self._target(session, request)
            args, kwargs = self._decode_args(session, request)
            with logs.routed_to(session.log):
                iterator = iter(target(*args, **kwargs))
            del args, kwargs
        except Refused:
            raise
        except Exception as e:  # noqa: BLE001
            yield pb.CallReply(error=remote_error(e), done=True)
            return
        try:
            while credits.take():
                if credits.ended.is_set() or not context.is_active():
                    return
                try:
                    with logs.routed_to(session.log):
                        item = next(iterator)
                    # a full arena waits for the blocks the controller is releasing, as a call's result does
                    timeout = self.config.alloc_timeout_seconds
                    encoded = self.arena.encode(item, session.id, f"item of {request.name}", timeout)
                    del item
                    result = self.arena.hand_over(encoded, session.id, timeout)
                except StopIteration:
                    break
                except Exception as e:  # noqa: BLE001 - also a full arena, or the session closed
                    yield pb.CallReply(error=remote_error(e), done=True)
                    return
                yield pb.CallReply(result=result)
            yield pb.CallReply(done=True)
        finally:
            getattr(iterator, "close", lambda: None)()

    def DeleteObject(self, request: pb.ObjectRef) -> pb.Empty:
        session = self.session(request.session_id)
        object_id = request.object_id
        if request.object_name:
            try:
                object_id = self.objects.find(request.object_name, session.name)
            except UnknownObjectError:
                return pb.Empty()
        self.objects.delete(object_id, session.id)
        return pb.Empty()

    def FindObject(self, request: pb.ObjectRef) -> pb.ObjectRef:
        session = self.session(request.session_id)
        try:
            object_id = self.objects.find(request.object_name, session.name)
        except UnknownObjectError as e:
            raise Refused(Status.NOT_FOUND, f"object: {e.args[0]}") from None
        return pb.ObjectRef(object_id=object_id, object_name=request.object_name)

    # --- blocks ----------------------------------------------------------------------------
    def Allocate(self, request: pb.AllocateRequest) -> pb.AllocateReply:
        session = self.session(request.session_id)
        allocator = self.arena.allocator
        try:
            pool, timeout = request.pool or "default", request.timeout_seconds
            blocks = allocator.allocate_all(list(request.sizes), owner=session.id, pool=pool, timeout=timeout)
        except ArenaFullError as e:
            raise self.quotas.arena_full(self.arena.arena.size, str(e)) from None
        except KeyError as e:  # an unknown pool
            raise Refused(Status.INVALID_ARGUMENT, str(e.args[0] if e.args else e)) from None
        return pb.AllocateReply(
            blocks=[pb.BlockDesc(id=b.id, offset=b.offset, nbytes=b.nbytes) for b in blocks]
        )

    def Release(self, request: pb.ReleaseRequest) -> pb.Empty:
        session = self.session(request.session_id)
        self._release(session, request.block_ids)
        return pb.Empty()

    def _release(self, session: Session, block_ids: Any) -> None:
        """Gives back the session's leases; one already freed (for example by a reconnect) is
        no error: releasing is idempotent."""
        for block_id in block_ids:
            with contextlib.suppress(UnknownBlockError):
                self.arena.allocator.release(block_id, session.id)

    def Upload(self, request_iterator: Iterator[pb.Chunk]) -> pb.BlockDesc:
        first = next(request_iterator, None)
        if first is None:
            raise Refused(Status.INVALID_ARGUMENT, "empty upload")
        session = self.session(first.session_id)
        allocator = self.arena.allocator
        try:
            block = allocator.allocate(
                first.total_bytes,
                owner=session.id,
                pool=first.pool or "default",
                timeout=self.config.alloc_timeout_seconds,
            )
        except ArenaFullError as e:
            raise self.quotas.arena_full(self.arena.arena.size, str(e)) from None
        except KeyError as e:  # unknown pool, as in Allocate
            raise Refused(Status.INVALID_ARGUMENT, str(e.args[0] if e.args else e)) from None
        written = 0
        try:
            for chunk in chain(first, request_iterator):
                end = written + len(chunk.data)
                if end > first.total_bytes:
                    raise BoundsError(f"upload exceeds its announced {first.total_bytes} bytes")
                self.arena.arena.buffer(block.offset + written, len(chunk.data))[:] = chunk.data
                written = end
            if written != first.total_bytes:
                raise BoundsError(f"upload ended after {written} of {first.total_bytes} bytes")
        except BoundsError as e:
            allocator.release(block.id, session.id)
            raise Refused(Status.INVALID_ARGUMENT, str(e)) from None
        except BaseException:
            allocator.release(block.id, session.id)
            raise
        return pb.BlockDesc(id=block.id, offset=block.offset, nbytes=first.total_bytes)

    def Download(self, request: pb.BlockRef) -> Iterator[pb.Chunk]:
        session = self.session(request.session_id)
        try:
            block = self.arena.allocator.check(request.block_id, session.id)
        except UnknownBlockError:
            raise Refused(
                Status.INVALID_ARGUMENT, f"block {request.block_id} is not leased by this session"
            ) from None
        offset, nbytes = (request.offset, request.nbytes) if request.nbytes else (block.offset, block.nbytes)
        if not block.offset <= offset <= offset + nbytes <= block.offset + block.nbytes:
            raise Refused(Status.INVALID_ARGUMENT, f"region {offset}+{nbytes} is not within block {block.id}")
        for start in range(0, nbytes, CHUNK_BYTES):
            n = min(CHUNK_BYTES, nbytes - start)
            yield pb.Chunk(data=bytes(self.arena.arena.buffer(offset + start, n)))

    # --- observability ---------------------------------------------------------------------
    def Logs(self, request: pb.SessionRef, context: Any) -> Iterator[pb.LogLine]:
        """The session's log lines as a stream (see `PollLogs`, which controllers use)."""
        session = self.session(request.session_id)
        while context.is_active() and not session.closed and not self.draining:
            for text in session.take_lines(0.5, self._is_draining, LOG_POLL_LINES):
                yield pb.LogLine(text=text)

    def PollLogs(self, request: pb.LogPoll) -> pb.LogLines:
        """The session's pending log lines; waits up to `wait_seconds` (at most a minute) for
        the first one. Returns within half a second of the session closing or a drain."""
        session = self.session(request.session_id)
        wait = min(max(request.wait_seconds, 0.0), 60.0)
        return pb.LogLines(lines=session.take_lines(wait, self._is_draining, LOG_POLL_LINES))

    def _is_draining(self) -> bool:
        return self.draining

    def Stats(self, request: pb.Empty) -> pb.StatsReply:
        self.arena.flush()
        p50, p99 = self.stats.latency_us()
        pools = [pb.PoolStats(name=name, **values) for name, values in self.arena.allocator.stats().items()]
        return pb.StatsReply(
            calls=self.stats.calls,
            errors=self.stats.errors,
            latency_p50_us=p50,
            latency_p99_us=p99,
            sessions=len(self.sessions),
            objects=len(self.objects),
            in_flight=self.stats.in_flight,
            pools=pools,
            uptime_seconds=time.monotonic() - self.stats.started,
            worker_processes=len(self.workers) if self.workers else 0,
            abandoned_calls=self.cancels.abandoned(),
            tenant=self.quotas.tenant,
            quota_refusals=dict(self.quotas.refusals),
        )

    def stop(self) -> None:
        self._sweeper_stop.set()
        self.sessions.stop()
