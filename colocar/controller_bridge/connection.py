"""The controller's link to one sidecar: a thin composition of parts with one job each.

Runs in the controller (device owner). One `HostConnection` per sidecar holds:
- the session (`session.py`: connect, keepalive, lost, generation),
- the transport of unary calls (`transport.py`: the local link when the controller is on the
  sidecar's host, else gRPC) and the ordering lanes on top of it (`lanes.py`),
- the background releases, deletes and cancels (`releases.py`),
- the log forwarder (`logs.py`),
- and the block transport: the sidecar's arena mapped here when it is reachable (same host,
  same shm dir; detected by attaching and checking the arena's nonce), else chunked gRPC
  streams.

Its other attributes and methods delegate to these parts (so that callers keep working while
they move to the parts themselves).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc
import numpy as np

from colocar.errors import ColocarError, HostLostError
from colocar.protocol import colocar_pb2 as pb
from colocar.protocol import serialization
from colocar.protocol.status import TransportError
from colocar.shm import (
    Arena,
    ShmUnavailableError,
    block_of,
    copy_into,
    holds,
    ndarray_view,
)

from .lanes import LaneFuture, Lanes, Send
from .link_client import LinkClient
from .logs import LogForwarder
from .releases import Releases
from .session import Session
from .transport import GrpcTransport, LinkTransport, Unsent, grpc_failure, translate

CHUNK_BYTES = 1 << 20


class HostConnection:
    """A session with one sidecar, and the transport of calls and arrays to it."""

    def __init__(
        self,
        address: str,
        name: str,
        token: str | None,
        *,
        shm: bool = True,
        lease_seconds: float = 30.0,
        heartbeat_seconds: float = 1.0,
        connect_timeout: float = 30.0,
        alloc_timeout: float = 30.0,
        credentials: grpc.ChannelCredentials | None = None,
        process_status: Callable[[], str | None] | None = None,
    ):
        self.alloc_timeout = alloc_timeout
        self._token = token or ""
        self.grpc = GrpcTransport(address, self._token, heartbeat_seconds, credentials, self.discard_reply)
        self.transport = LinkTransport(self.grpc, name, self.discard_reply)
        self.session = Session(
            address,
            name,
            self.transport,
            self.grpc,
            self._connected,
            lease_seconds=lease_seconds,
            heartbeat_seconds=heartbeat_seconds,
            process_status=process_status,
        )
        self.releases = Releases(name, self.session, self.transport, self._forget_views)
        self._reclaimer = self.releases.reclaimer
        self.lanes = Lanes(self.discard_reply)
        self._want_shm = shm
        self.arena: Arena | None = None
        self._views: dict[int, int] = {}  # offset -> block id of arena views we hold
        self._views_lock = threading.Lock()
        try:
            self.session.connect(connect_timeout)
        except BaseException:  # refused (token, version skew) or unreachable: leave nothing behind
            self.releases.close()
            self.transport.close()
            self.grpc.close()
            raise
        self.logs = LogForwarder(self.session, self.transport)
        self.session.start()

    # --- connect: the arena and the local link ---------------------------------------------
    def _connected(self, reply: pb.ConnectReply) -> None:
        """After each (re)connect: maps the sidecar's arena if reachable, then opens the link."""
        self._attach_arena(reply)
        link = None
        if self.arena is not None and reply.link_path:
            try:
                link = LinkClient(
                    reply.link_path, self._token, lambda: self.session.unresponsive, self.heartbeat_seconds
                )
            except (OSError, TransportError):
                link = None  # not reachable from here: every call goes through gRPC
        self.transport.attach(link)

    def _attach_arena(self, reply: pb.ConnectReply) -> None:
        if self._want_shm and (self.arena is None or self.arena.nonce != reply.arena_nonce):
            try:
                self.arena = Arena.attach(reply.arena_path, reply.arena_size, reply.arena_nonce)
            except ShmUnavailableError:
                self.arena = None  # another host or another shm dir: bytes go through gRPC

    def _forget_views(self, blocks: list[tuple[int, int]]) -> None:
        """Blocks given back: the views at their offsets are no longer ours."""
        if not blocks:
            return
        with self._views_lock:
            for block_id, offset in blocks:
                if self._views.get(offset) == block_id:
                    del self._views[offset]

    # --- calls -----------------------------------------------------------------------------
    def translate(self, e: TransportError | grpc.RpcError, what: str) -> Exception:
        """A failed call (either transport, or a gRPC stream) as the error a user should see."""
        failure = grpc_failure(e) if isinstance(e, grpc.RpcError) else e
        return translate(failure, what, self.session)

    def unary(self, method: str, request: Any, timeout: float | None = None) -> Any:
        self.session.check_alive()
        try:
            return self.transport.call(method, request, timeout)
        except TransportError as e:
            raise self.translate(e, method) from None

    def stats(self) -> pb.StatsReply:
        return self.unary("Stats", pb.Empty(), timeout=10)

    # --- arrays ----------------------------------------------------------------------------
    @property
    def shm(self) -> bool:
        return self.arena is not None

    def own_block(self, array: np.ndarray) -> pb.BlockDesc | None:
        """The block, if `array` is exactly one of our views of this sidecar's arena."""
        found = block_of(array)
        if found is None or found[0] is not self.arena:
            return None
        with self._views_lock:
            block_id = self._views.get(found[1])
        return None if block_id is None else pb.BlockDesc(id=block_id, offset=found[1], nbytes=found[2])

    def _view(self, desc: pb.BlockDesc, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        assert self.arena is not None
        with self._views_lock:
            self._views[desc.offset] = desc.id
        block_id, offset = desc.id, desc.offset

        def release() -> None:
            self._reclaimer.push(("block", block_id, offset))

        return ndarray_view(self.arena, desc.offset, shape, dtype, on_release=release)

    def empty(
        self, specs: list[tuple[tuple[int, ...], np.dtype]], pool: str = "", timeout: float | None = None
    ) -> list[np.ndarray]:
        """Staging arrays in the sidecar's arena (shm only), one Allocate for all of them;
        passing them to a call copies nothing."""
        for _, dtype in specs:  # before allocating: nothing to give back
            if not holds(dtype):
                raise TypeError(f"dtype {np.dtype(dtype)} cannot live in the arena; use np.empty")
        sizes = [int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize for shape, dtype in specs]
        descs = self.allocate(sizes, pool, timeout)
        return [
            self._view(d, tuple(shape), np.dtype(dtype))
            for d, (shape, dtype) in zip(descs, specs, strict=True)
        ]

    def allocate(self, sizes: list[int], pool: str = "", timeout: float | None = None) -> list[pb.BlockDesc]:
        """Blocks leased to this session; waits up to `timeout` s (default: alloc_timeout) for room."""
        timeout = self.alloc_timeout if timeout is None else timeout
        request = pb.AllocateRequest(
            session_id=self.session_id, sizes=sizes, pool=pool, timeout_seconds=timeout
        )
        return list(self.unary("Allocate", request, timeout=timeout + 30).blocks)

    def encode(self, value: Any, what: str) -> tuple[pb.Payload, list[int], list[np.ndarray]]:
        """Pickles call arguments; large arrays go to arena blocks (or uploads).

        Returns the payload, the block ids the call consumes (allocated for it here), and the
        arrays it references, which the caller keeps alive until the call completed (so that
        a Release of a block we hold cannot overtake the call).
        """
        arrays: list[np.ndarray] = []

        def sink(array: np.ndarray) -> int:
            arrays.append(array)
            return len(arrays) - 1

        data = serialization.dumps(value, sink, what=what)
        if not arrays:
            return pb.Payload(pickle=data), [], []
        descs: list[pb.BlockDesc | None] = [None] * len(arrays)
        fresh = []
        for i, array in enumerate(arrays):
            descs[i] = self.own_block(array) if self.shm else None
            if descs[i] is None:
                fresh.append(i)
        consumed = []
        if self.shm and fresh:
            allocated = self.allocate([arrays[i].nbytes for i in fresh])
            try:
                for i, desc in zip(fresh, allocated, strict=True):
                    copy_into(self.arena, desc.offset, arrays[i])  # type: ignore[arg-type]
                    descs[i] = desc
                    consumed.append(desc.id)
            except BaseException:  # interrupted: no call will consume them
                self.release_soon(d.id for d in allocated)
                raise
        else:
            for i in fresh:
                descs[i] = self.upload(arrays[i])
                consumed.append(descs[i].id)  # type: ignore[union-attr]
        return pb.Payload(pickle=data, blocks=[d for d in descs if d is not None]), consumed, arrays

    def decode(self, payload: pb.Payload) -> Any:
        """Unpickles a result; arrays become views of the arena (or downloads, without shm)."""
        descs = list(payload.blocks)
        used: set[int] = set()

        def source(index: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
            desc = descs[index]
            used.add(index)
            if self.shm:
                return self._view(desc, shape, dtype)
            return self.download(desc, shape, dtype)

        try:
            return serialization.loads(payload.pickle, source)
        finally:
            for i, desc in enumerate(descs):
                if i not in used or not self.shm:
                    self._reclaimer.push(("block", desc.id, desc.offset))

    def upload(self, array: np.ndarray) -> pb.BlockDesc:
        data = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
        total = data.nbytes

        def chunks() -> Iterator[pb.Chunk]:
            yield pb.Chunk(session_id=self.session_id, total_bytes=total, data=bytes(data[:CHUNK_BYTES]))
            for start in range(CHUNK_BYTES, total, CHUNK_BYTES):
                yield pb.Chunk(data=bytes(data[start : start + CHUNK_BYTES]))

        self.check_alive()
        try:
            return self.stub.Upload(chunks(), metadata=self.metadata)
        except grpc.RpcError as e:
            raise self.translate(e, "upload") from None

    def download(self, desc: pb.BlockDesc, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        out = np.empty(shape, dtype)
        target = out.reshape(-1).view(np.uint8)
        position = 0
        try:
            for chunk in self.stub.Download(
                pb.BlockRef(session_id=self.session_id, block_id=desc.id), metadata=self.metadata
            ):
                n = len(chunk.data)
                target[position : position + n] = np.frombuffer(chunk.data, np.uint8)
                position += n
        except grpc.RpcError as e:
            raise self.translate(e, "download") from None
        if position != out.nbytes:
            raise ColocarError(f"download of block {desc.id} ended after {position} of {out.nbytes} bytes")
        return out

    # --- delegations to the parts ------------------------------------------------------------
    @property
    def address(self) -> str:
        return self.session.address

    @property
    def name(self) -> str:
        return self.session.name

    @property
    def session_id(self) -> str:
        return self.session.session_id

    @property
    def lease_seconds(self) -> float:
        return self.session.lease_seconds

    @property
    def heartbeat_seconds(self) -> float:
        return self.session.heartbeat_seconds

    @property
    def generation(self) -> int:
        return self.session.generation

    @property
    def lost(self) -> HostLostError | None:
        return self.session.lost

    @property
    def unresponsive(self) -> bool:
        return self.session.unresponsive

    @property
    def info(self) -> pb.ConnectReply:
        return self.session.info

    @property
    def known_code(self) -> set[bytes]:
        return self.session.known_code

    @property
    def alive_at(self) -> float:
        return self.session.alive_at

    @alive_at.setter
    def alive_at(self, value: float) -> None:
        self.session.alive_at = value

    def heartbeat(self) -> None:
        self.session.heartbeat()

    def mark_lost(self, reason: str) -> None:
        self.session.mark_lost(reason)

    def check_alive(self) -> None:
        self.session.check_alive()

    @property
    def link(self) -> LinkClient | None:
        return self.transport.link

    @property
    def stub(self) -> Any:
        return self.grpc.stub

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return self.grpc.metadata

    @property
    def channel(self) -> grpc.Channel:
        return self.grpc.channel

    def sync(self, method: str, request: Any, timeout: float | None = None, unsent: Unsent = None) -> Any:
        return self.transport.call(method, request, timeout, unsent)

    def submit(self, send: Send, unsent: Callable[[], None] | None = None) -> LaneFuture:
        return self.lanes.submit(send, unsent)

    def lane_idle(self) -> bool:
        return self.lanes.idle()

    def discard_reply(self, reply: Any) -> None:
        self.releases.discard_reply(reply)

    def release_soon(self, block_ids: Iterable[int]) -> None:
        self.releases.release_soon(block_ids)

    def cancel_soon(self, call_id: int) -> None:
        self.releases.cancel_soon(call_id)

    def delete_object_soon(self, object_id: int, generation: int) -> None:
        self.releases.delete_object_soon(object_id, generation)

    def next_call_id(self) -> int:
        return self.session.next_call_id()

    # --- shutdown --------------------------------------------------------------------------
    def close(self) -> None:
        if self.session.closed:
            return
        self.releases.flush(timeout=5)
        self.session.close()
        self.releases.close()
        self.transport.close()
        self.grpc.close()
        self.logs.join(timeout=5)
