"""A pool of worker processes for CPU-bound shipped functions (`@colocated(processes=True)`).

Built on `multiprocess` (dill pickling) with the forkserver start method: the sidecar has gRPC
threads, so it never forks itself. Each worker maps the arena (see `worker_main`); this side
allocates blocks on the worker's behalf under a per-task owner, so whatever the worker does,
blocks it did not return are freed when the task ends (unless its views outlive the call: those
stay leased for the worker, see `worker_main`), and a worker that dies mid-call costs a clear
error and a fresh worker, never a leak. A call its controller cancels (see `cancels`) is
stopped the same way: its worker is killed and replaced.
"""

from __future__ import annotations

import collections
import itertools
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import multiprocess

from colocar.protocol import colocar_pb2 as pb
from colocar.protocol import messages
from colocar.protocol.messages import Alloc, Call, Done, Failed, Full, Granted, Log, NoPool
from colocar.shm import ArenaFullError, UnknownBlockError

from . import cancels
from .blocks import SidecarArena
from .func_backend import MAX_CACHED_CODE, CodeNotFound


class WorkerDiedError(RuntimeError):
    """The worker process running the call exited (killed, crashed, out of memory)."""


class WorkerCancelledError(WorkerDiedError):
    """The call's controller cancelled it: its worker process was killed (a new one replaces it)."""


class _Process:
    def __init__(self, ctx: Any, arena: SidecarArena):
        from colocar.sidecar import worker_main

        self.conn, child = ctx.Pipe(duplex=True)
        self.known_code: set[bytes] = set()  # hashes this worker has loaded
        a = arena.arena
        self.process = ctx.Process(
            target=worker_main.main, args=(child, a.path, a.size, a.nonce, os.getpid()), daemon=True
        )
        self.process.start()
        child.close()
        self.owner = f"worker:{self.process.pid}"  # leases on blocks its views keep across calls

    def stop(self) -> None:
        try:
            self.conn.send(messages.pack(None))
        except (OSError, ValueError):
            pass
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        self.conn.close()

    def kill(self) -> None:
        """Ends the process now (it is busy in user code and would not read a stop message)."""
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class WorkerPool:
    """At most `size` worker processes, started on first use and replaced when they die."""

    def __init__(self, size: int, arena: SidecarArena, start_method: str = "forkserver"):
        self.size = size
        self._arena = arena
        self._ctx = multiprocess.get_context(start_method)
        self._idle: queue.Queue[_Process] = queue.Queue()
        self._started = 0
        self._lock = threading.Lock()
        self._tasks = itertools.count()
        self._all: list[_Process] = []
        # Calls carry code only the first time the sidecar sees it; a worker that has not seen
        # it yet (another worker, or a fresh one after a death) gets it from here.
        self._code: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self._code_lock = threading.Lock()

    def _code_bytes(self, request: pb.CallRequest) -> bytes:
        """The request's code (remembered, or from the request); CodeNotFound if neither."""
        with self._code_lock:
            if request.code:
                self._code[request.code_hash] = request.code
            code = self._code.get(request.code_hash, b"")
            if code:
                self._code.move_to_end(request.code_hash)
            while len(self._code) > MAX_CACHED_CODE:
                self._code.popitem(last=False)
        if not code:
            raise CodeNotFound(request.name)  # the controller resends it
        return code

    def __len__(self) -> int:
        return sum(p.process.is_alive() for p in self._all)

    def _acquire(self, token: cancels.CancelToken | None) -> _Process:
        """An idle worker, or a new one while the pool has room (again after a worker was
        discarded); gives up if the call is cancelled meanwhile."""
        while True:
            with self._lock:
                if self._idle.empty() and self._started < self.size:
                    self._started += 1
                    worker = _Process(self._ctx, self._arena)
                    self._all.append(worker)
                    return worker
            try:
                return self._idle.get(timeout=0.2)
            except queue.Empty:
                if token is not None and token.cancelled:
                    raise WorkerCancelledError("the call was cancelled by its caller before it ran") from None

    def _discard(self, worker: _Process, kill: bool = False) -> None:
        if kill:
            worker.kill()
        else:
            worker.stop()
        self._arena.allocator.release_owner(worker.owner)
        with self._lock:
            self._started -= 1
            self._all.remove(worker)

    def run(
        self,
        session_id: str,
        request: pb.CallRequest,
        log: Callable[[str], None],
        alloc_timeout: float,
    ) -> pb.CallReply:
        """Runs a FUNCTION request in a worker; the reply's blocks are leased to the session."""
        arena = self._arena
        code = self._code_bytes(request)
        owner = f"task:{next(self._tasks)}"
        blocks = [arena.check(desc, session_id) for desc in request.args.blocks]
        for block in blocks:
            arena.allocator.acquire(block.id, owner)
        for block_id in request.consume_blocks:
            arena.allocator.release(block_id, session_id)
        token = cancels.current()
        worker = None
        try:
            worker = self._acquire(token)
            call = Call(
                request.code_hash,
                b"" if request.code_hash in worker.known_code else code,
                request.name,
                request.args.pickle,
                [(b.id, b.offset, b.nbytes) for b in blocks],
            )
            worker.conn.send(messages.pack(call))
            end = self._serve(worker, token, owner, log, alloc_timeout)
            self._settle(worker, end.kept, end.gone)
            self._idle.put(worker)
            if isinstance(end, Failed):
                error = pb.RemoteError(
                    exception=end.exception, type=end.type, message=end.message, traceback=end.traceback
                )
                return pb.CallReply(error=error)
            worker.known_code.add(request.code_hash)
            descs = []
            for block_id in end.block_ids:
                block = arena.allocator.acquire(block_id, session_id)
                descs.append(pb.BlockDesc(id=block.id, offset=block.offset, nbytes=block.nbytes))
            return pb.CallReply(result=pb.Payload(pickle=end.pickle, blocks=descs))
        except WorkerDiedError as e:
            if worker is not None:  # None: cancelled while waiting for one
                self._discard(worker, kill=isinstance(e, WorkerCancelledError))
            raise
        finally:
            arena.allocator.release_owner(owner)

    def _serve(
        self,
        worker: _Process,
        token: cancels.CancelToken | None,
        owner: str,
        log: Callable[[str], None],
        alloc_timeout: float,
    ) -> Done | Failed:
        """Answers the worker's requests (blocks for the task `owner`, log lines) until the
        call ends; returns its last message."""
        while True:
            message = messages.unpack(self._receive(worker, token))
            if isinstance(message, Log):
                log(message.line)
            elif isinstance(message, Alloc):
                answer: Granted | Full | NoPool
                try:
                    block = self._arena.allocator.allocate(
                        message.nbytes, owner=owner, pool=message.pool, timeout=alloc_timeout
                    )
                    answer = Granted(block.id, block.offset)
                except ArenaFullError as e:
                    answer = Full(str(e))
                except KeyError as e:  # unknown pool
                    answer = NoPool(e.args[0] if e.args else str(e))
                worker.conn.send(messages.pack(answer))
            else:
                return message

    def _settle(self, worker: _Process, kept: list[int], gone: list[int]) -> None:
        """Blocks the worker's views still reach stay leased for it, until it says they are gone."""
        allocator = self._arena.allocator
        for block_id in kept:
            allocator.acquire(block_id, worker.owner)
        for block_id in gone:
            try:
                allocator.release(block_id, worker.owner)
            except UnknownBlockError:
                pass

    @staticmethod
    def _receive(worker: _Process, token: cancels.CancelToken | None) -> Any:
        """The worker's next message; raises if it died, or if the call was cancelled."""
        while True:
            if token is not None and token.cancelled:
                raise WorkerCancelledError(
                    f"the call was cancelled by its caller: its worker process (pid "
                    f"{worker.process.pid}) was stopped; a new worker takes the next call"
                )
            try:
                if worker.conn.poll(0.2):
                    return worker.conn.recv()
            except (EOFError, OSError):
                pass
            else:
                if worker.process.is_alive():
                    continue
            worker.process.join(timeout=1)
            raise WorkerDiedError(
                f"the worker process (pid {worker.process.pid}) running the call died with exit "
                f"code {worker.process.exitcode}; a new worker takes the next call"
            )

    def close(self) -> None:
        with self._lock:
            workers, self._all = self._all, []
        for worker in workers:
            worker.stop()
            self._arena.allocator.release_owner(worker.owner)
