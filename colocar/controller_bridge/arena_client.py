"""The controller's side of one sidecar's arena: staging arrays, payloads, uploads, downloads.

Runs in the controller (device owner). When the sidecar's arena is reachable from here (same
host, same shm dir: `attach` maps it and checks its nonce), arrays go to and come from its
blocks as zero-copy views; otherwise through chunked gRPC streams (`Upload`, `Download`).
Every view this client makes carries a `BlockHandle` (the block id, and this client's arena as
its home), so the payload codec (`protocol.payload`) shares such a view's block when it is
passed to a call, with no table of addresses to look it up in. A view's block lease goes back
to the sidecar (`release_soon`) once no array derived from it is alive.

Everything that needs the session comes in as callables (`unary` for `Allocate`, `stream`
for uploads and downloads, `release_soon`), so this client does not know the connection.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc
import numpy as np

from colocar.errors import ColocarError
from colocar.protocol import colocar_pb2 as pb
from colocar.protocol import payload
from colocar.shm import Arena, ShmUnavailableError, holds, ndarray_view
from colocar.shm.views import BlockHandle

from .sigint import sigint_held

CHUNK_BYTES = 1 << 20


class ArenaClient(payload.BlockSpace):
    """A controller session's blocks in one sidecar's arena (mapped here, or reached by gRPC).

    `unary(method, request, timeout)` sends one RPC of the session (errors already translated);
    `stream(what, run, check)` runs `run(stub, metadata)` for a streaming RPC, translating its
    errors (and first checking that the session is alive, if `check`);
    `release_soon(block_ids)` gives blocks back in the background (safe in a finalizer).
    """

    def __init__(
        self,
        session_id: str,
        want_shm: bool,
        alloc_timeout: float,
        unary: Callable[[str, Any, float | None], Any],
        stream: Callable[[str, Callable[[Any, Any], Any], bool], Any],
        *,
        release_soon: Callable[[Iterable[int]], None],
    ):
        self.session_id = session_id
        self.alloc_timeout = alloc_timeout
        self.arena: Arena | None = None
        self._want_shm = want_shm
        self._unary = unary
        self._stream = stream
        self._release_soon = release_soon

    def attach(self, reply: pb.ConnectReply) -> None:
        """Maps the arena a (re)connect names, unless it is already mapped; an arena this
        process cannot map (another host, another shm dir) means gRPC streams from now on."""
        if self._want_shm and (self.arena is None or self.arena.nonce != reply.arena_nonce):
            try:
                self.arena = Arena.attach(reply.arena_path, reply.arena_size, reply.arena_nonce)
                self.arena.prefault_in_background()
            except ShmUnavailableError:
                self.arena = None

    def detach(self) -> None:
        """Drops this client's reference to the arena (its session ended): the mapping lives
        as long as arrays over it, no longer."""
        self.arena = None

    @property
    def mapped(self) -> bool:
        return self.arena is not None

    # --- blocks ----------------------------------------------------------------------------
    def empty(
        self, specs: list[tuple[tuple[int, ...], np.dtype]], pool: str = "", timeout: float | None = None
    ) -> list[np.ndarray]:
        """Staging arrays in the sidecar's arena (mapped only), one Allocate for all of them;
        passing them to a call copies nothing."""
        for _, dtype in specs:  # before allocating: nothing to give back
            if not holds(dtype):
                raise TypeError(f"dtype {np.dtype(dtype)} cannot live in the arena; use np.empty")
        sizes = [int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize for shape, dtype in specs]
        descs = self.allocate(sizes, pool, timeout)
        return [
            self.view(d, tuple(shape), np.dtype(dtype))
            for d, (shape, dtype) in zip(descs, specs, strict=True)
        ]

    def allocate(self, sizes: list[int], pool: str = "", timeout: float | None = None) -> list[pb.BlockDesc]:
        """Blocks leased to this session; waits up to `timeout` s (default: alloc_timeout) for room."""
        timeout = self.alloc_timeout if timeout is None else timeout
        request = pb.AllocateRequest(
            session_id=self.session_id, sizes=sizes, pool=pool, timeout_seconds=timeout
        )
        return list(self._unary("Allocate", request, timeout + 30).blocks)

    def release(self, descs: list[pb.BlockDesc]) -> None:
        self._release_soon([desc.id for desc in descs])

    def view(self, desc: pb.BlockDesc, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A view of a block of the mapped arena; its lease goes back once the view is gone."""
        assert self.arena is not None
        block_id, release_soon = desc.id, self._release_soon
        return ndarray_view(
            self.arena,
            desc.offset,
            shape,
            dtype,
            on_release=lambda: release_soon((block_id,)),
            handle=BlockHandle(block_id, self.arena),
        )

    def place(self, arrays: list[np.ndarray]) -> list[pb.BlockDesc]:
        if self.arena is not None:
            return super().place(arrays)
        return payload.all_or_none(arrays, self.upload, self.release)  # no arena here: uploads

    # --- payloads --------------------------------------------------------------------------
    def encode(self, value: Any, what: str, into: pb.Payload) -> tuple[list[int], list[np.ndarray]]:
        """Pickles call arguments into `into` (a request's payload field); large arrays go to
        arena blocks (or uploads).

        Returns the block ids the call consumes (allocated for it here), and the arrays it
        references, which the caller keeps alive until the call completed (so that a Release
        of a block we hold cannot overtake the call).
        """
        encoded = payload.encode(self, value, what, keep=True, into=into)
        return encoded.fresh_ids(), encoded.arrays

    def decode(self, reply: pb.Payload) -> Any:
        """Unpickles a result; arrays become views of the arena (or downloads, unmapped)."""
        if not reply.blocks:
            return payload.decode(reply.pickle, (), self.view)
        descs = list(reply.blocks)
        used: set[int] = set()
        mapped = self.arena is not None
        try:
            return payload.decode(reply.pickle, descs, self.view if mapped else self.download, used)
        finally:  # a view gives its block back when it dies; a download has copied it
            self._release_soon([d.id for i, d in enumerate(descs) if i not in used or not mapped])

    # --- without a mapped arena ------------------------------------------------------------
    def upload(self, array: np.ndarray) -> pb.BlockDesc:
        data = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
        total = data.nbytes

        def chunks() -> Iterator[pb.Chunk]:
            yield pb.Chunk(session_id=self.session_id, total_bytes=total, data=bytes(data[:CHUNK_BYTES]))
            for start in range(CHUNK_BYTES, total, CHUNK_BYTES):
                yield pb.Chunk(data=bytes(data[start : start + CHUNK_BYTES]))

        return self._stream("upload", lambda stub, metadata: stub.Upload(chunks(), metadata=metadata), True)

    def download(self, desc: pb.BlockDesc, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        out = np.empty(shape, dtype)
        target = out.reshape(-1).view(np.uint8)
        # the payload's region of the block: a shared part of a block is not all of it
        request = pb.BlockRef(
            session_id=self.session_id, block_id=desc.id, offset=desc.offset, nbytes=desc.nbytes
        )

        def receive(stub: Any, metadata: Any) -> int:
            position = 0
            with sigint_held():  # see sigint.py
                replies = stub.Download(request, metadata=metadata)
            for chunk in replies:
                n = len(chunk.data)
                target[position : position + n] = np.frombuffer(chunk.data, np.uint8)
                position += n
            return position

        position = self._stream("download", receive, False)
        if position != out.nbytes:
            raise ColocarError(f"download of block {desc.id} ended after {position} of {out.nbytes} bytes")
        return out


def run_stream(
    stub: Any,
    metadata: Any,
    check_alive: Callable[[], None],
    translate: Callable[[grpc.RpcError, str], Exception],
    what: str,
    run: Callable[[Any, Any], Any],
    check: bool,
) -> Any:
    """`run(stub, metadata)` for one streaming RPC (of a live session, if `check`), its gRPC
    errors as the errors a user should see."""
    if check:
        check_alive()
    try:
        return run(stub, metadata)
    except grpc.RpcError as e:
        raise translate(e, what) from None
