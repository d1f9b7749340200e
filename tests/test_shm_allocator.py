"""Tests of colocar.shm's block allocator: alignment, pools, waiting when full, coalescing,
threads and leases.
"""

from __future__ import annotations

import random
import threading

import pytest

from colocar.shm import (
    HEADER_BYTES,
    Allocator,
    ArenaFullError,
    OwnerEndedError,
    UnknownBlockError,
)

MiB = 1 << 20


def test_alignment_and_ids():
    alloc = Allocator(HEADER_BYTES, 4 * MiB)
    small = [alloc.allocate(n, owner="o") for n in (1, 63, 65, 0, 1000)]
    large = [alloc.allocate(n, owner="o") for n in (64 * 1024, 100_000, 1)]
    for b in small + large[2:]:
        assert b.offset % 64 == 0 and b.offset >= HEADER_BYTES and b.pool == "default"
    for b in large[:2]:
        assert b.offset % 4096 == 0
    blocks = small + large
    ids = [b.id for b in blocks]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert len({b.offset for b in blocks}) == len(blocks)  # 0-byte blocks get their own offset
    spans = sorted((b.offset, b.offset + b.nbytes) for b in blocks)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))
    assert blocks[3].nbytes == 0 and alloc.stats()["default"]["blocks"] == len(blocks)
    for b in blocks:
        assert alloc.release(b.id, "o")
    again = alloc.allocate(10, owner="o")
    assert again.id > max(ids)  # ids are never reused


def test_pools_are_isolated_and_validated():
    alloc = Allocator(HEADER_BYTES, 4 * MiB, pools={"ckpt": MiB, "batches": MiB})
    stats = alloc.stats()
    assert stats["ckpt"]["reserved"] == MiB and stats["batches"]["reserved"] == MiB
    assert stats["default"]["reserved"] == 2 * MiB
    filled = alloc.allocate(MiB, owner="o", pool="ckpt")
    with pytest.raises(ArenaFullError, match="ckpt"):
        alloc.allocate(1, owner="o", pool="ckpt")
    other = alloc.allocate(MiB, owner="o", pool="batches")
    default = alloc.allocate(2 * MiB, owner="o")
    regions = sorted((b.offset, b.offset + b.nbytes) for b in (filled, other, default))
    assert all(end <= nxt for (_, end), (nxt, _) in zip(regions, regions[1:], strict=False))
    assert regions[-1][1] <= HEADER_BYTES + 4 * MiB
    with pytest.raises(KeyError, match="ckpt"):
        alloc.allocate(1, owner="o", pool="nope")
    with pytest.raises(ValueError):
        Allocator(HEADER_BYTES, MiB, pools={"a": MiB, "b": 1})
    with pytest.raises(ValueError):
        Allocator(HEADER_BYTES, MiB, pools={"a": MiB // 2, "default": MiB})


def test_full_pool_waits_then_raises_and_free_unblocks_waiter():
    alloc = Allocator(HEADER_BYTES, MiB)
    hog = alloc.allocate(MiB, owner="hog")
    with pytest.raises(ArenaFullError) as info:
        alloc.allocate(4096, owner="w", timeout=0.2)
    message = str(info.value)
    for part in ("'default'", "4096", "largest free extent 0", "1 live blocks", "Release"):
        assert part in message
    with pytest.raises(ArenaFullError, match="larger than the whole pool"):
        alloc.allocate(2 * MiB, owner="w", timeout=60)  # fails at once, no wait

    waiting = threading.Event()
    result: list[object] = []

    def waiter() -> None:
        waiting.set()
        try:
            result.append(alloc.allocate(MiB // 2, owner="w", timeout=60))
        except Exception as e:  # noqa: BLE001
            result.append(e)

    thread = threading.Thread(target=waiter)
    thread.start()
    assert waiting.wait(30)
    assert alloc.release(hog.id, "hog")
    thread.join(60)
    assert not thread.is_alive()
    assert len(result) == 1 and alloc.check(result[0].id, "w") == result[0]


def test_coalescing_restores_one_free_extent():
    size = 2 * MiB
    alloc = Allocator(HEADER_BYTES, size)
    rng = random.Random(0)
    blocks = []
    while True:
        try:
            blocks.append(alloc.allocate(rng.choice([0, 1, 100, 5000, 70_000]), owner="o"))
        except ArenaFullError:
            break
    assert len(blocks) > 20
    rng.shuffle(blocks)
    for b in blocks:
        assert alloc.release(b.id, "o")
    stats = alloc.stats()["default"]
    assert stats == {
        "reserved": size,
        "used": 0,
        "peak": stats["peak"],
        "blocks": 0,
        "largest_free": size,
        "allocated": stats["allocated"],
    }
    assert stats["peak"] > size // 2
    assert stats["allocated"] >= stats["peak"]  # every block counted, none taken back
    whole = alloc.allocate(size, owner="o")
    assert whole.offset == HEADER_BYTES


def test_concurrent_allocate_release():
    alloc = Allocator(HEADER_BYTES, 8 * MiB, pools={"p": MiB})

    def work(seed: int) -> None:
        rng = random.Random(seed)
        held = []
        for _ in range(300):
            if held and rng.random() < 0.5:
                alloc.release(held.pop(rng.randrange(len(held))).id, f"t{seed}")
            else:
                pool = rng.choice(["p", "default"])
                try:
                    held.append(alloc.allocate(rng.randrange(200_000), owner=f"t{seed}", pool=pool))
                except ArenaFullError:
                    pass  # others hold the room; waiting here could deadlock all threads
        alloc.release_owner(f"t{seed}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stats = alloc.stats()
    assert stats["p"]["used"] == stats["default"]["used"] == 0
    assert stats["p"]["largest_free"] == MiB
    assert stats["default"]["largest_free"] == 7 * MiB


def test_leases():
    alloc = Allocator(HEADER_BYTES, MiB)
    a = alloc.allocate(100, owner="s1")
    b = alloc.allocate(100, owner="s1")
    assert alloc.check(a.id, "s1") == a
    with pytest.raises(UnknownBlockError):
        alloc.check(a.id, "s2")
    with pytest.raises(UnknownBlockError):
        alloc.release(a.id, "s2")
    assert alloc.acquire(a.id, "s2") == a
    assert alloc.acquire(a.id, "s2") == a
    assert alloc.check(a.id, "s2") == a
    assert not alloc.release(a.id, "s1")
    with pytest.raises(UnknownBlockError):
        alloc.check(a.id, "s1")
    assert not alloc.release(a.id, "s2")
    assert alloc.release(a.id, "s2")  # last lease: freed
    with pytest.raises(UnknownBlockError):
        alloc.acquire(a.id, "s2")
    with pytest.raises(UnknownBlockError):
        alloc.check(a.id, "s2")
    alloc.acquire(b.id, "s2")
    assert alloc.release_owner("s1") == 0  # s2 still holds b
    assert alloc.check(b.id, "s2") == b
    alloc.acquire(b.id, "s2")
    c = alloc.allocate(1, owner="s2")
    assert alloc.release_owner("s2") == 2
    assert alloc.release_owner("s2") == 0
    assert alloc.stats()["default"]["blocks"] == 0
    with pytest.raises(UnknownBlockError):
        alloc.check(c.id, "s2")


def test_an_ended_owner_is_freed_and_can_lease_nothing_more():
    alloc = Allocator(HEADER_BYTES, 4 * MiB)
    mine, other = alloc.allocate(1000, owner="s1"), alloc.allocate(1000, owner="s2")
    assert alloc.end_owner("s1") == 1
    with pytest.raises(OwnerEndedError, match="'s1' ended"):
        alloc.allocate(1000, owner="s1")
    with pytest.raises(OwnerEndedError):
        alloc.acquire(other.id, "s1")
    with pytest.raises(UnknownBlockError):
        alloc.release(mine.id, "s1")
    assert alloc.leases(other.id) == 1 and alloc.allocate(10, owner="s2").id > other.id
