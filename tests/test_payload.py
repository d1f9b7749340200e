"""Tests of the payload codec (`protocol.payload`) and the typed pipe and feed messages
(`protocol.messages`), in one process over a real sidecar arena."""

from __future__ import annotations

import numpy as np
import pytest

from colocar.protocol import colocar_pb2 as pb
from colocar.protocol import messages, payload
from colocar.protocol.messages import FeedMessage
from colocar.shm import ArenaFullError, ndarray_view
from colocar.shm.views import handle_of
from colocar.sidecar.blocks import SidecarArena

MiB = 1 << 20
OWNER = "session"


@pytest.fixture
def arena(shm_dir):
    arena = SidecarArena(shm_dir, 8 * MiB, pools={"small": MiB}, label="payloadtest")
    yield arena
    arena.close()


def _used(arena: SidecarArena) -> int:
    arena.flush()
    return sum(pool["blocks"] for pool in arena.allocator.stats().values())


def test_views_name_their_block_and_home_only_when_whole(arena):
    view = arena.empty((1000,), np.float32)
    found = handle_of(view)
    assert found is not None and found[0].home is arena.arena and found[2] == view.nbytes
    assert handle_of(view[1:]) is None and handle_of(view[::2]) is None
    plain = ndarray_view(arena.arena, found[1], (1000,), np.float32)  # no handle: plain bytes
    assert handle_of(plain) is None


def test_a_view_nothing_else_holds_is_shared_and_one_still_held_is_copied(arena):
    kept = arena.empty((100_000,), np.float32)
    kept[:] = 1.0
    given = arena.empty((100_000,), np.float32)
    given[:] = 2.0
    kept_id, given_id = handle_of(kept)[0].id, handle_of(given)[0].id  # type: ignore[index]
    encoded = arena.encode({"kept": kept, "given": given}, OWNER)
    assert [d.id for d in encoded.payload.blocks] == [kept_id, given_id]
    del given  # the caller drops the value; `kept` is still reachable here
    sent = arena.hand_over(encoded, OWNER)
    ids = [d.id for d in sent.blocks]
    assert ids[1] == given_id, "a block nothing here reaches is shared, not copied"
    assert ids[0] != kept_id, "a block this process still reaches is copied"
    kept[:] = 3.0  # writing the kept view does not change what was sent
    value = arena.decode(sent, OWNER)
    assert float(value["kept"][0]) == 1.0 and float(value["given"][0]) == 2.0
    del value
    for desc in sent.blocks:
        arena.allocator.release(desc.id, OWNER)
    del kept
    assert _used(arena) == 0


def test_a_failed_encode_gives_back_every_block_it_took(arena):
    shared = arena.empty((1000,), np.uint8)
    big = np.ones(4 * MiB, np.uint8)
    with pytest.raises(ArenaFullError):
        payload.encode(_Small(arena), [shared, np.ones(MiB // 2, np.uint8), big], "value")
    del shared
    assert _used(arena) == 0


def test_decode_refuses_a_reference_past_the_blocks_sent(arena):
    encoded = arena.encode(np.zeros(100_000, np.uint8), OWNER)
    sent = arena.hand_over(encoded, OWNER)
    bad = pb.Payload(pickle=sent.pickle)  # the reference, without its block
    with pytest.raises(payload.BoundsError, match="only 0 blocks sent"):
        arena.decode(bad, OWNER)
    arena.allocator.release(sent.blocks[0].id, OWNER)
    assert _used(arena) == 0


class _Small(payload.BlockSpace):
    """A space whose blocks come from the arena's small pool (1 MiB), leased to OWNER."""

    def __init__(self, arena: SidecarArena):
        self.arena = arena.arena
        self._allocator = arena.allocator

    def allocate_one(self, nbytes: int) -> pb.BlockDesc:
        block = self._allocator.allocate(nbytes, owner=OWNER, pool="small")
        return pb.BlockDesc(id=block.id, offset=block.offset, nbytes=nbytes)

    def release(self, descs: list[pb.BlockDesc]) -> None:
        for desc in descs:
            self._allocator.release(desc.id, OWNER)

    def share(self, block_id: int, offset: int, nbytes: int) -> pb.BlockDesc:
        self._allocator.acquire(block_id, OWNER)
        return pb.BlockDesc(id=block_id, offset=offset, nbytes=nbytes)

    unshare = release


@pytest.mark.parametrize(
    "message",
    [
        messages.Call(b"h", b"code", "f", b"pickle", [(1, 4096, 10)]),
        messages.Alloc(100, "default"),
        messages.Granted(3, 8192),
        messages.Full("no room"),
        messages.NoPool("nope"),
        messages.Log("line"),
        messages.Done(b"p", [1, 2], [3], [4]),
        messages.Failed(b"", "ValueError", "bad", "tb", [], [5]),
        messages.Build(7, 1),
        messages.Built(7, 1, 0),
        messages.BuildFailed(7, 1, "ValueError: x", "tb"),
        None,
    ],
)
def test_pipe_messages_travel_as_plain_tuples(message):
    packed = messages.pack(message)
    assert packed is None or all(type(x) in (str, bytes, int, list) for x in packed)
    back = messages.unpack(packed)
    assert back == message and type(back) is type(message)


def test_feed_messages_are_read_in_place_header_then_tail():
    batch = FeedMessage(4, 2, 1).pack()
    end = FeedMessage(5, -1, 1, ("error", "batch 5 failed")).pack()
    buffer = bytearray(batch + end)
    assert FeedMessage.read(buffer, 0, 3) == messages.FEED_HEADER.size  # header incomplete
    first = FeedMessage.read(buffer, 0, len(buffer))
    assert isinstance(first, FeedMessage) and first[:4] == (4, 2, 1, None) and first.size == len(batch)
    need = FeedMessage.read(buffer, len(batch), len(batch) + messages.FEED_HEADER.size)
    assert need == len(end)  # the header says how long the tail is
    last = FeedMessage.read(buffer, len(batch), len(buffer))
    assert isinstance(last, FeedMessage) and last.tail == ("error", "batch 5 failed")
