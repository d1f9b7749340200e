"""The small messages between a sidecar and its helper processes, and of the batch feed.

Every process that speaks them imports this module (the sidecar, call workers, pipeline
workers, the controller's feed). Three channels, each with its messages defined together:

- **call-worker pipe** (`sidecar/workers.py` <-> `sidecar/worker_main.py`): the sidecar sends
  `Call` (or None: stop); the worker asks for blocks with `Alloc` (answered `Granted`, `Full`
  or `NoPool`), forwards output with `Log`, and ends a call with `Done` or `Failed`;
- **pipeline-worker pipe** (`loaders/pump.py` <-> `loaders/worker.py`): `Build` (or None:
  stop) in, `Built` or `BuildFailed` out;
- **feed** (`loaders/pump.py` -> `loaders/feed.py`): `FeedMessage`, a fixed struct plus an
  optional pickled tail, parsed in place from the receiver's buffer (one per batch: no
  pickling and no buffer allocated for it).

On a pipe a message travels as a plain tuple `(kind, *fields)` (`pack`; `unpack` makes it a
message again): pickling a tuple of builtins is cheaper than a class instance, and neither end
needs the other's classes to read it.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any, NamedTuple

Blocks = list[tuple[int, int, int]]  # (id, offset, nbytes) of a call's input blocks


# --- the call-worker pipe --------------------------------------------------------------------
class Call(NamedTuple):
    """Sidecar -> worker: run `name` (its code, or b"" when the worker has it) on the pickled
    arguments, whose arrays are views of `blocks`."""

    code_hash: bytes
    code: bytes
    name: str
    pickle: bytes
    blocks: Blocks


class Alloc(NamedTuple):
    """Worker -> sidecar: a block of `nbytes` in `pool`, leased to the call's task."""

    nbytes: int
    pool: str


class Granted(NamedTuple):
    """Sidecar -> worker: the block allocated for an `Alloc`."""

    block_id: int
    offset: int


class Full(NamedTuple):
    """Sidecar -> worker: no room for an `Alloc` (raised as `ArenaFullError`)."""

    text: str


class NoPool(NamedTuple):
    """Sidecar -> worker: an `Alloc` named an unknown pool (raised as `KeyError`)."""

    text: str


class Log(NamedTuple):
    """Worker -> sidecar: a line the call printed."""

    line: str


class Done(NamedTuple):
    """Worker -> sidecar: the call's result (its arrays in `block_ids`); `kept`: blocks whose
    views outlived the call (the sidecar keeps them leased for the worker); `gone`: blocks kept
    earlier whose views are gone now."""

    pickle: bytes
    block_ids: list[int]
    kept: list[int]
    gone: list[int]


class Failed(NamedTuple):
    """Worker -> sidecar: the call raised (see `func_backend.error_fields`); kept and gone as
    in `Done`."""

    exception: bytes
    type: str
    message: str
    traceback: str
    kept: list[int]
    gone: list[int]


# --- the pipeline-worker pipe ----------------------------------------------------------------
class Build(NamedTuple):
    """Pump -> pipeline worker: write this host's rows of global batch `k` into ring slot `slot`."""

    k: int
    slot: int


class Built(NamedTuple):
    """Pipeline worker -> pump: batch `k` is in `slot`; `bad`: records skipped for it."""

    k: int
    slot: int
    bad: int


class BuildFailed(NamedTuple):
    """Pipeline worker -> pump: batch `k` failed (its slot goes back)."""

    k: int
    slot: int
    text: str
    traceback: str


_KINDS: dict[type, str] = {
    Call: "call",
    Alloc: "alloc",
    Granted: "block",
    Full: "full",
    NoPool: "nopool",
    Log: "log",
    Done: "done",
    Failed: "error",
    Build: "build",
    Built: "built",
    BuildFailed: "failed",
}
_TYPES: dict[str, Any] = {kind: cls for cls, kind in _KINDS.items()}


def pack(message: NamedTuple | None) -> tuple | None:
    """A message as the plain tuple that travels on a pipe (None, the stop signal, as it is)."""
    return None if message is None else (_KINDS[type(message)], *message)


def unpack(data: tuple | None) -> Any:
    """The message a `pack`ed tuple stands for (None as it is)."""
    return None if data is None else _TYPES[data[0]](*data[1:])


def send_pickled(conn: Any, message: NamedTuple | None) -> None:
    """A message on a pipe as a plain pickle: `multiprocess`'s own `send` pickles with dill,
    ~25 us for a tiny tuple, paid twice per batch on each side of a pipeline."""
    conn.send_bytes(pickle.dumps(pack(message), protocol=pickle.HIGHEST_PROTOCOL))


def receive_pickled(conn: Any) -> Any:
    return unpack(pickle.loads(conn.recv_bytes()))


# --- the feed --------------------------------------------------------------------------------
class FeedMessage(NamedTuple):
    """Pump -> controller feed: batch `k` is in ring slot `slot`, `bad` records skipped so far.

    A batch has no tail; the last message has one: `("end",)` (the data ended), `("error",
    text)`, or `("stopped",)` (the pipeline was closed on the sidecar first; slot -1).
    On the socket: struct `FEED_HEADER` (tail length, k, slot, bad) then the pickled tail;
    `size` is the message's length there (set by `read`). The controller's feed unpacks a
    batch's bare header itself (`loaders.feed.Feed.receive`, once per batch) and `read`s only
    a message with a tail.
    """

    k: int
    slot: int
    bad: int
    tail: tuple | None = None
    size: int = 0

    def pack(self) -> bytes:
        tail = b"" if self.tail is None else pickle.dumps(self.tail, protocol=pickle.HIGHEST_PROTOCOL)
        return FEED_HEADER.pack(len(tail), self.k, self.slot, self.bad) + tail

    @staticmethod
    def read(buffer: bytearray, start: int, end: int) -> FeedMessage | int:
        """The message at `buffer[start:end]`, or while it is incomplete the length it needs
        (the header's, then the header's and the tail's)."""
        need = FEED_HEADER.size
        if end - start < need:
            return need
        n, k, slot, bad = FEED_HEADER.unpack_from(buffer, start)
        need += n
        if end - start < need:
            return need
        tail = pickle.loads(buffer[start + FEED_HEADER.size : start + need]) if n else None
        return FeedMessage(k, slot, bad, tail, need)


FEED_HEADER = struct.Struct("<Iqiq")
