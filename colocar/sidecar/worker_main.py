"""The body of a sidecar worker process (runs CPU-bound shipped functions off the sidecar's GIL).

The worker maps the sidecar's arena itself: inputs are zero-copy views of the call's blocks,
and array results are written straight into blocks that the parent allocates on request, so
no array ever crosses the pipe. The pipe carries only small control tuples:

    parent -> worker: ("call", code_hash, code, name, pickle, [(id, offset, nbytes), ...]) | None
    worker -> parent: ("alloc", nbytes, pool) -> ("block", id, offset) | ("full" | "nopool", message)
                      ("log", line)
                      ("done", pickle, [block ids], kept, gone)
                      ("error", pickled, type, message, tb, kept, gone)

A view the function kept beyond its call (a module-level cache) must not point at memory that
is freed and reused: its block ids come back as `kept`, and the parent holds them leased for
this worker until a later reply lists them as `gone`. A kept block that is also a result is
copied first, so that the caller's array never changes.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import Any

import numpy as np

from colocar.protocol import serialization
from colocar.shm import Arena, ArenaFullError, block_of, holds, ndarray_view
from colocar.shm import context as shm_context
from colocar.shm.views import reach


class _PipeLog:
    """stdout/stderr of the worker while it runs a call: each line goes to the parent."""

    def __init__(self, send: Any):
        self._send = send
        self._buffer = ""

    def write(self, text: str) -> int:
        *lines, self._buffer = (self._buffer + text).split("\n")
        for line in lines:
            self._send(("log", line))
        return len(text)

    def flush(self) -> None:
        pass

    def close_line(self) -> None:
        if self._buffer:
            self._send(("log", self._buffer))
            self._buffer = ""


class _Worker:
    def __init__(self, conn: Any, arena: Arena):
        self.conn = conn
        self.arena = arena
        self.codes: dict[bytes, Any] = {}
        self.task_blocks: dict[int, tuple[int, int]] = {}  # offset -> (block id, nbytes)
        self.views: list[tuple[int, weakref.ref]] = []  # (block id, reach) of this call's views
        self.kept: list[tuple[int, weakref.ref]] = []  # views that outlived their call
        self.lock = threading.Lock()

    def allocate(self, nbytes: int, pool: str = "default") -> tuple[int, int]:
        with self.lock:
            self.conn.send(("alloc", nbytes, pool))
            reply = self.conn.recv()
        if reply[0] == "full":
            raise ArenaFullError(reply[1])
        if reply[0] == "nopool":
            raise KeyError(reply[1])
        _, block_id, offset = reply
        self.task_blocks[offset] = (block_id, nbytes)
        return block_id, offset

    def view(self, block_id: int, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        array = ndarray_view(self.arena, offset, shape, dtype)
        self.views.append((block_id, reach(array)))  # type: ignore[arg-type]
        return array

    def empty(self, shape: tuple[int, ...], dtype: np.dtype, pool: str) -> np.ndarray:
        if not holds(dtype):  # checked before allocating: a failed view must not leak the block
            raise TypeError(f"dtype {dtype} cannot live in the arena; use np.empty")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        block_id, offset = self.allocate(nbytes, pool)
        return self.view(block_id, offset, shape, dtype)

    def copy(self, array: np.ndarray) -> int:
        block_id, offset = self.allocate(array.nbytes)
        target = np.frombuffer(self.arena.buffer(offset, array.nbytes), dtype=array.dtype)
        np.copyto(target.reshape(array.shape), array, casting="no")
        return block_id

    def sink(self, ids: list[int], shared: list[tuple[int, weakref.ref | None, int]]) -> Any:
        def put(array: np.ndarray) -> int:
            found = block_of(array)
            offset = found[1] if found and found[0] is self.arena else -1
            known = self.task_blocks.get(offset)
            if known is not None and known[1] == array.nbytes:
                shared.append((len(ids), reach(array), offset))
                ids.append(known[0])
            else:
                ids.append(self.copy(array))
            return len(ids) - 1

        return put

    def unshare(self, ids: list[int], shared: list[tuple[int, weakref.ref | None, int]]) -> None:
        """Copies result blocks that an array of this process still reaches (the function kept
        it): the caller's `jax.Array` must never change. Call after dropping the result."""
        for index, view, offset in shared:
            if view is not None and view() is not None:
                nbytes = self.task_blocks[offset][1]
                ids[index] = self.copy(np.frombuffer(self.arena.buffer(offset, nbytes), np.uint8))

    def settle(self) -> tuple[list[int], list[int]]:
        """(blocks whose views outlived this call: the parent keeps them leased for this
        worker; blocks kept earlier whose views are gone now: the parent lets them go)."""
        still = [(i, v) for i, v in self.kept if v() is not None]
        gone = sorted({i for i, _ in self.kept} - {i for i, _ in still})
        fresh = [(i, v) for i, v in self.views if v() is not None]
        self.kept = still + fresh
        self.views = []
        return sorted({i for i, _ in fresh}), gone

    def run(self, code_hash: bytes, code: bytes, name: str, pickle: bytes, blocks: list) -> None:
        self.task_blocks.clear()
        reply = self.call(code_hash, code, name, pickle, blocks)
        self.conn.send((*reply, *self.settle()))

    def call(self, code_hash: bytes, code: bytes, name: str, pickle: bytes, blocks: list) -> tuple:
        from colocar.sidecar.func_backend import error_fields, load_code

        log = _PipeLog(self.conn.send)
        try:
            fn = self.codes.get(code_hash)
            if fn is None:
                fn = self.codes[code_hash] = load_code(code, name)

            def source(index: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
                block_id, offset, _ = blocks[index]
                return self.view(block_id, offset, shape, dtype)

            args, kwargs = serialization.loads(pickle, source)
            sys.stdout = sys.stderr = log  # type: ignore[assignment]
            try:
                result = fn(*args, **kwargs)
            finally:
                log.close_line()
                sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
            ids: list[int] = []
            shared: list[tuple[int, weakref.ref | None, int]] = []
            data = serialization.dumps(result, self.sink(ids, shared), what=f"result of {name}")
            del args, kwargs, result
            self.unshare(ids, shared)
            return ("done", data, ids)
        except BaseException as e:  # noqa: BLE001 - everything goes back to the caller
            return ("error", *error_fields(e))


def main(conn: Any, arena_path: str, arena_size: int, arena_nonce: str) -> None:
    """Entry point of a worker process (started with forkserver or spawn, never plain fork)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    worker = _Worker(conn, Arena.attach(arena_path, arena_size, arena_nonce))
    shm_context.install(worker.empty)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        _, code_hash, code, name, pickle, blocks = message
        worker.run(code_hash, code, name, pickle, blocks)
