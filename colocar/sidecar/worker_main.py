"""The body of a sidecar worker process (runs CPU-bound shipped functions off the sidecar's GIL).

The worker maps the sidecar's arena itself: inputs are zero-copy views of the call's blocks,
and array results are written straight into blocks that the parent allocates on request, so
no array ever crosses the pipe. The pipe carries only the small messages of
`protocol.messages` (`Call` in; `Alloc`, `Log`, `Done` or `Failed` out).

Results are coded by `protocol.payload` over the call's task (`_TaskSpace`): a block allocated
in this call and returned as a whole view is shared, unless the function kept a view of it
(then it is copied, so that the caller's array never changes). A view the function kept beyond
its call (a module-level cache) must not point at memory that is freed and reused: its block
ids come back as `kept`, and the parent holds them leased for this worker until a later reply
lists them as `gone`.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import Any

import numpy as np

from colocar.protocol import colocar_pb2 as pb
from colocar.protocol import messages, payload
from colocar.protocol.messages import Alloc, Call, Done, Failed, Full, Log, NoPool
from colocar.shm import Arena, ArenaFullError, holds, ndarray_view
from colocar.shm import context as shm_context
from colocar.shm.views import BlockHandle, reach

from .lifeline import end_with


class _PipeLog:
    """stdout/stderr of the worker while it runs a call: each line goes to the parent."""

    def __init__(self, send: Any):
        self._send = send
        self._buffer = ""

    def write(self, text: str) -> int:
        *lines, self._buffer = (self._buffer + text).split("\n")
        for line in lines:
            self._send(messages.pack(Log(line)))
        return len(text)

    def flush(self) -> None:
        pass

    def close_line(self) -> None:
        if self._buffer:
            self._send(messages.pack(Log(self._buffer)))
            self._buffer = ""


class _TaskSpace(payload.BlockSpace):
    """Blocks as one call sees them: a block allocated during the call (a `colocar.shm.empty`
    result) may be shared by its result; inputs and views kept from earlier calls are copied.
    Every block allocated here is leased to the call's task by the parent, which frees those
    the reply does not name when the task ends: nothing to give back here."""

    def __init__(self, worker: _Worker):
        self.arena = worker.arena
        self._worker = worker
        self._home = object()  # this call only

    @property
    def home(self) -> object:
        return self._home

    def allocate_one(self, nbytes: int) -> pb.BlockDesc:
        block_id, offset = self._worker.allocate(nbytes)
        return pb.BlockDesc(id=block_id, offset=offset, nbytes=nbytes)

    def release(self, descs: list[pb.BlockDesc]) -> None:
        pass

    def view(self, desc: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        block_id, offset, _ = desc
        return self._worker.view(block_id, offset, shape, dtype)


class _Worker:
    def __init__(self, conn: Any, arena: Arena):
        self.conn = conn
        self.arena = arena
        self.codes: dict[bytes, Any] = {}
        self.task = _TaskSpace(self)
        self.views: list[tuple[int, weakref.ref]] = []  # (block id, reach) of this call's views
        self.kept: list[tuple[int, weakref.ref]] = []  # views that outlived their call
        self.lock = threading.Lock()

    def allocate(self, nbytes: int, pool: str = "default") -> tuple[int, int]:
        with self.lock:
            self.conn.send(messages.pack(Alloc(nbytes, pool)))
            reply = messages.unpack(self.conn.recv())
        if isinstance(reply, Full):
            raise ArenaFullError(reply.text)
        if isinstance(reply, NoPool):
            raise KeyError(reply.text)
        return reply.block_id, reply.offset

    def view(
        self,
        block_id: int,
        offset: int,
        shape: tuple[int, ...],
        dtype: np.dtype,
        handle: BlockHandle | None = None,
    ) -> np.ndarray:
        array = ndarray_view(self.arena, offset, shape, dtype, handle=handle)
        self.views.append((block_id, reach(array)))  # type: ignore[arg-type]
        return array

    def empty(self, shape: tuple[int, ...], dtype: np.dtype, pool: str) -> np.ndarray:
        if not holds(dtype):  # checked before allocating: a failed view must not leak the block
            raise TypeError(f"dtype {dtype} cannot live in the arena; use np.empty")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        block_id, offset = self.allocate(nbytes, pool)
        return self.view(block_id, offset, shape, dtype, BlockHandle(block_id, self.task.home))

    def settle(self) -> tuple[list[int], list[int]]:
        """(blocks whose views outlived this call: the parent keeps them leased for this
        worker; blocks kept earlier whose views are gone now: the parent lets them go)."""
        still = [(i, v) for i, v in self.kept if v() is not None]
        gone = sorted({i for i, _ in self.kept} - {i for i, _ in still})
        fresh = [(i, v) for i, v in self.views if v() is not None]
        self.kept = still + fresh
        self.views = []
        return sorted({i for i, _ in fresh}), gone

    def run(self, call: Call) -> None:
        self.task = _TaskSpace(self)
        reply = self.call(call)
        kept, gone = self.settle()
        self.conn.send(messages.pack(reply._replace(kept=kept, gone=gone)))

    def call(self, call: Call) -> Done | Failed:
        from colocar.sidecar.func_backend import error_fields, load_code

        log = _PipeLog(self.conn.send)
        try:
            fn = self.codes.get(call.code_hash)
            if fn is None:
                fn = self.codes[call.code_hash] = load_code(call.code, call.name)
            args, kwargs = payload.decode(call.pickle, call.blocks, self.task.view)
            sys.stdout = sys.stderr = log  # type: ignore[assignment]
            try:
                result = fn(*args, **kwargs)
            finally:
                log.close_line()
                sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
            encoded = payload.encode(self.task, result, what=f"result of {call.name}")
            del args, kwargs, result
            sent = payload.hand_over(self.task, encoded)  # copies what the function kept
            return Done(sent.pickle, [desc.id for desc in sent.blocks], [], [])
        except BaseException as e:  # noqa: BLE001 - everything goes back to the caller
            return Failed(*error_fields(e), [], [])


def main(conn: Any, arena_path: str, arena_size: int, arena_nonce: str, sidecar_pid: int) -> None:
    """Entry point of a worker process (started with forkserver or spawn, never plain fork);
    it ends with its sidecar, however that ends."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    end_with(sidecar_pid)
    worker = _Worker(conn, Arena.attach(arena_path, arena_size, arena_nonce))
    shm_context.install(worker.empty)
    while True:
        try:
            message = messages.unpack(conn.recv())
        except (EOFError, OSError):
            return
        if message is None:
            return
        worker.run(message)
