"""Tests of colocar.shm: arena files, the block allocator and zero-copy numpy views."""

from __future__ import annotations

import gc
import os
import random
import signal
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from colocar.shm import (
    HEADER_BYTES,
    Allocator,
    Arena,
    ArenaFullError,
    ShmUnavailableError,
    UnknownBlockError,
    arena_offset,
    block_of,
    ndarray_view,
    remove_stale_arenas,
)

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def _python(code: str, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def _run(code: str) -> str:
    proc = _python(code)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return out


@pytest.fixture
def arena(tmp_path):
    a = Arena.create(str(tmp_path), 4 * MiB, label="test")
    yield a
    a.unlink()
    a.close()


# ---------------------------------------------------------------- arena


def test_create_attach_round_trip_across_processes(arena):
    arena.buffer(HEADER_BYTES, 5)[:] = b"hello"
    out = _run(
        f"""
        from colocar.shm import Arena
        a = Arena.attach({arena.path!r}, {arena.size}, {arena.nonce!r})
        print(bytes(a.buffer({HEADER_BYTES}, 5)).decode())
        a.buffer({HEADER_BYTES + 100}, 3)[:] = b"abc"
        a.close()
        """
    )
    assert out.strip() == "hello"
    assert bytes(arena.buffer(HEADER_BYTES + 100, 3)) == b"abc"


def test_arena_file_name_mode_and_header(arena, tmp_path):
    name = os.path.basename(arena.path)
    assert name.startswith(f"colocar-test-{os.getpid()}-") and name.endswith(".arena")
    st = os.stat(arena.path)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_size == arena.size == 4 * MiB
    assert len(arena.nonce) == 32 and int(arena.nonce, 16) >= 0
    assert sorted(os.listdir(tmp_path)) == [name]  # no temporary file left behind
    assert arena.owner and not arena.closed


def test_attach_rejects_wrong_nonce_size_and_missing_file(arena, tmp_path):
    with pytest.raises(ShmUnavailableError, match="nonce"):
        Arena.attach(arena.path, arena.size, "0" * 32)
    with pytest.raises(ShmUnavailableError, match="bytes"):
        Arena.attach(arena.path, arena.size + 4096, arena.nonce)
    with pytest.raises(ShmUnavailableError, match="not on this host"):
        Arena.attach(str(tmp_path / "colocar-x-1-ab.arena"), arena.size, arena.nonce)
    junk = tmp_path / "junk.arena"
    junk.write_bytes(b"\0" * arena.size)
    with pytest.raises(ShmUnavailableError, match="magic"):
        Arena.attach(str(junk), arena.size, arena.nonce)


def test_create_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        Arena.create(str(tmp_path), HEADER_BYTES)
    with pytest.raises(ValueError):
        Arena.create(str(tmp_path), MiB, label="a/b")
    with pytest.raises(ShmUnavailableError):
        Arena.create(str(tmp_path / "missing"), MiB)


def test_buffer_bounds_contains_and_close(arena):
    with pytest.raises(ValueError):
        arena.buffer(0, 8)  # the header is not handed out
    with pytest.raises(ValueError):
        arena.buffer(arena.size - 4, 8)
    assert len(arena.buffer(arena.size - 8, 8)) == 8
    base = arena.base_address
    assert arena.contains(base + HEADER_BYTES, arena.size - HEADER_BYTES)
    assert not arena.contains(base, 8)
    assert not arena.contains(base + arena.size - 4, 8)
    view = ndarray_view(arena, HEADER_BYTES, (4,), np.int32)
    view[:] = 7
    arena.close()  # views still exported: best effort, no exception
    arena.close()
    assert arena.closed and view.sum() == 28
    with pytest.raises(ValueError):
        arena.buffer(HEADER_BYTES, 1)


def test_unlink_is_idempotent_and_owner_only(tmp_path):
    a = Arena.create(str(tmp_path), MiB)
    b = Arena.attach(a.path, a.size, a.nonce)
    with pytest.raises(PermissionError):
        b.unlink()
    a.unlink()
    a.unlink()
    assert not os.path.exists(a.path)
    b.buffer(HEADER_BYTES, 1)[0] = 9  # mappings outlive the file name
    assert a.buffer(HEADER_BYTES, 1)[0] == 9
    a.close()
    b.close()


def test_remove_stale_arenas_kills_only_dead_owners(tmp_path):
    code = f"""
        import sys, time
        from colocar.shm import Arena
        a = Arena.create({str(tmp_path)!r}, 1 << 20, label="child")
        print(a.path, flush=True)
        time.sleep(120)
        """
    dead, live = _python(code), _python(code)
    try:
        dead_path = dead.stdout.readline().strip()
        live_path = live.stdout.readline().strip()
        assert os.path.exists(dead_path) and os.path.exists(live_path)
        mine = Arena.create(str(tmp_path), MiB)
        dead.send_signal(signal.SIGKILL)
        dead.wait(timeout=30)
        assert remove_stale_arenas(str(tmp_path)) == [dead_path]
        assert not os.path.exists(dead_path)
        assert os.path.exists(live_path) and os.path.exists(mine.path)
        assert remove_stale_arenas(str(tmp_path)) == []
        mine.close()  # the lock goes with the owner: now it is stale too
        assert remove_stale_arenas(str(tmp_path)) == [mine.path]
    finally:
        for proc in (dead, live):
            proc.kill()
            proc.communicate(timeout=30)


# ---------------------------------------------------------------- allocator


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
    }
    assert stats["peak"] > size // 2
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


# ---------------------------------------------------------------- views


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((3, 5), np.float32), ((2, 4, 3), ml_dtypes.bfloat16), ((), np.float64), ((0, 7), np.int16)],
)
def test_ndarray_view_dtypes(arena, shape, dtype):
    alloc = Allocator(HEADER_BYTES, arena.size - HEADER_BYTES)
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    block = alloc.allocate(nbytes, owner="o")
    view = ndarray_view(arena, block.offset, shape, dtype)
    assert view.shape == shape and view.dtype == np.dtype(dtype)
    assert view.flags.c_contiguous and view.flags.writeable
    assert view.__array_interface__["data"][0] == arena.base_address + block.offset
    data = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape).astype(dtype)
    view[...] = data
    again = ndarray_view(arena, block.offset, shape, dtype)
    np.testing.assert_array_equal(again, data)
    assert block_of(view) == (arena, block.offset, nbytes)


def test_ndarray_view_visible_in_other_process(arena):
    view = ndarray_view(arena, HEADER_BYTES + 4096, (4, 4), ml_dtypes.bfloat16)
    view[...] = np.eye(4, dtype=ml_dtypes.bfloat16)
    out = _run(
        f"""
        import ml_dtypes, numpy as np
        from colocar.shm import Arena, ndarray_view
        a = Arena.attach({arena.path!r}, {arena.size}, {arena.nonce!r})
        v = ndarray_view(a, {HEADER_BYTES + 4096}, (4, 4), ml_dtypes.bfloat16)
        print(float(v.astype(np.float32).sum()))
        v[0, 1] = 5
        """
    )
    assert float(out) == 4.0
    assert float(view[0, 1]) == 5.0


def test_on_release_fires_once_after_last_derived_view(arena):
    calls: list[int] = []
    view = ndarray_view(arena, HEADER_BYTES, (8, 8), np.float32, on_release=lambda: calls.append(1))
    row = view[2]
    alias = view.view(np.int32).reshape(64)
    as_array = np.asarray(view)
    del view
    gc.collect()
    assert calls == []
    del row, as_array
    gc.collect()
    assert calls == []
    cycle: list[object] = [alias]
    cycle.append(cycle)  # only the cycle collector can free this one
    del alias, cycle
    gc.collect()
    assert calls == [1]
    gc.collect()
    assert calls == [1]


def test_view_bounds_are_checked(arena):
    with pytest.raises(ValueError):
        ndarray_view(arena, arena.size - 8, (4,), np.float32)
    with pytest.raises(ValueError):
        ndarray_view(arena, 0, (4,), np.float32)


def test_block_of_and_arena_offset(arena, tmp_path):
    off = HEADER_BYTES + 8192
    view = ndarray_view(arena, off, (16, 4), np.float32)
    assert block_of(view) == (arena, off, 256)
    assert block_of(view.reshape(64)) == (arena, off, 256)
    assert block_of(view.view(np.uint8)) == (arena, off, 256)
    assert block_of(view[1:]) is None
    assert block_of(view[:, :2]) is None
    assert block_of(view[:8]) is None
    assert block_of(np.zeros((16, 4), np.float32)) is None
    assert block_of(view.copy()) is None

    assert arena_offset(arena, view) == off
    assert arena_offset(arena, view[1:]) == off + 16
    assert arena_offset(arena, view[:, 1]) == off + 4
    assert arena_offset(arena, view[::-1]) == off + 15 * 16
    assert arena_offset(arena, np.zeros(4)) is None
    other = Arena.create(str(tmp_path), MiB)
    try:
        assert arena_offset(other, view) is None
    finally:
        other.unlink()
        other.close()


def test_shm_does_not_import_jax():
    out = _run(
        """
        import sys
        import colocar.shm
        print(sorted(m for m in ("jax", "grpc", "jaxlib") if m in sys.modules))
        """
    )
    assert out.strip() == "[]"


def test_slot_ring_waits_for_its_consumer_and_reuses_slots(shm_dir):
    """A full ring has no slot until a consumer lets go of one (the allocator's release listener
    fires, as the pump waits for it) or one is given back unpublished (`abandon`), and names the
    starvation when nothing comes back."""
    from colocar.shm.ring import RingStarvedError
    from colocar.sidecar.blocks import SidecarArena

    arena = SidecarArena(shm_dir, MiB, label="ringtest")
    ring = arena.ring(2, 4096)
    released = threading.Event()
    arena.allocator.add_release_listener(released.set)
    try:
        first, second = ring.try_acquire(), ring.try_acquire()
        held = ring.publish(first)
        held[:] = 7
        assert ring.try_acquire() is None
        starved = ring.starved(0.2)
        assert isinstance(starved, RingStarvedError) and "no free slot among 2" in str(starved)
        released.clear()
        del held  # the consumer drops the batch: its lease goes, the listener fires
        assert released.wait(60)
        assert ring.try_acquire() == first
        released.clear()
        ring.abandon(second)  # a slot given back without being published
        assert released.wait(60)
        assert ring.try_acquire() == second
    finally:
        arena.allocator.remove_release_listener(released.set)
        ring.close()
        arena.close()


def test_slot_ring_lends_slots_given_back_on_its_board(shm_dir):
    """A borrower gives lent slots back by bumping the board: silently while the ring's user
    has work queued (the next look finds the slot), with a signal once its user waits (the
    board's flag says so). Lent slots outlive `close` until given back; `return_lent` (the
    borrower is gone) frees them all and refuses further lending."""
    from colocar.shm import ndarray_view
    from colocar.shm.ring import WAITING, board_words
    from colocar.sidecar.blocks import SidecarArena

    arena = SidecarArena(shm_dir, MiB, label="lendtest")
    ring = arena.ring(2, 4096)
    board = ndarray_view(arena.arena, ring.board_block.offset, (board_words(2),), np.int64)  # the borrower's
    leases = lambda i: arena.allocator.leases(ring.blocks[i].id)  # noqa: E731
    try:
        first, second = ring.try_acquire(), ring.try_acquire()
        assert ring.lend(first) and ring.lend(second)
        board[1 + first] += 1  # given back silently: a look finds it, no signal needed
        assert ring.try_acquire(urgent=False) == first
        assert ring.try_acquire(urgent=False) is None and board[WAITING] == 0  # no signal wanted
        assert ring.try_acquire(urgent=True) is None and board[WAITING] == 1  # now one is

        released = threading.Event()
        arena.allocator.add_release_listener(released.set)
        board[1 + second] += 1
        ring.reclaim_lent()  # the borrower's signal wakes the waiting user
        assert released.wait(60)
        arena.allocator.remove_release_listener(released.set)
        assert ring.try_acquire() == second and board[WAITING] == 0

        assert ring.lend(first)
        ring.close()
        assert (leases(first), leases(second)) == (1, 0)  # the lent slot stays, the other is freed
        board[1 + first] += 1
        ring.reclaim_lent()
        assert leases(first) == 0
        ring.return_lent()
        assert not ring.lend(second)
    finally:
        ring.close()
        arena.close()


def test_slot_ring_finds_a_slot_given_back_without_a_signal_at_its_next_look(shm_dir):
    """The board has no memory fence ("Ordering" in shm/ring.py): a borrower may read the flag
    as down although the ring's user already waits, and give a slot back with no signal. Nothing
    wakes the user then, but its next look (`try_acquire`, which it makes while it waits) finds
    the slot. And a return counts for one lending only: a slot lent again stays lent until the
    borrower bumps its counter again, whatever it did before."""
    from colocar.shm import ndarray_view
    from colocar.shm.ring import WAITING, board_words
    from colocar.sidecar.blocks import SidecarArena

    arena = SidecarArena(shm_dir, MiB, label="lostsignal")
    ring = arena.ring(2, 4096)
    board = ndarray_view(arena.arena, ring.board_block.offset, (board_words(2),), np.int64)  # the borrower's
    woken = threading.Event()
    arena.allocator.add_release_listener(woken.set)
    try:
        first, second = ring.try_acquire(), ring.try_acquire()
        assert ring.lend(first) and ring.lend(second)
        assert ring.try_acquire(urgent=True) is None and board[WAITING] == 1  # the user waits
        woken.clear()
        board[1 + second] += 1  # given back; the borrower read the flag as down: no `reclaim_lent`
        assert not woken.wait(0.2)  # nothing tells the user...
        assert ring.try_acquire(urgent=True) == second  # ...its next look finds the slot
        assert board[WAITING] == 0

        assert ring.lend(second)  # lent a second time; the board still counts one return
        assert ring.try_acquire(urgent=True) is None and ring.in_use() == 2
        board[1 + second] += 1
        assert ring.try_acquire(urgent=True) == second
    finally:
        arena.allocator.remove_release_listener(woken.set)
        ring.close()
        ring.return_lent()
        arena.close()
