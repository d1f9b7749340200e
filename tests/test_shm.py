"""Tests of colocar.shm: arena files and zero-copy numpy views (the allocator and the slot
ring are in test_shm_allocator.py and test_shm_ring.py).
"""

from __future__ import annotations

import gc
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from helpers import program, wait_for

from colocar.shm import (
    HEADER_BYTES,
    Allocator,
    Arena,
    ShmUnavailableError,
    arena_offset,
    block_of,
    ndarray_view,
    remove_stale_arenas,
)

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def _python(name: str, *args: object, **kwargs) -> subprocess.Popen:
    """Starts tests/programs/<name>.py with `args`, importing colocar from this checkout."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, program(name), *map(str, args)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def _run(name: str, *args: object) -> str:
    proc = _python(name, *args)
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
    out = _run("shm_attach_round_trip", arena.path, arena.size, arena.nonce, HEADER_BYTES)
    assert out.strip() == "hello"
    assert bytes(arena.buffer(HEADER_BYTES + 100, 3)) == b"abc"


def _resident_kib(mapping: Arena) -> int:
    """Resident KiB of this process's mapping of `mapping` (from /proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    start = f"{mapping.base_address:x}-"
    for i, line in enumerate(lines):
        if line.startswith(start):
            return next(int(x.split()[1]) for x in lines[i + 1 :] if x.startswith("Rss:"))
    raise AssertionError(f"{mapping} is not mapped")


def test_attach_maps_lazily_then_prefaults_on_a_thread(arena):
    arena.buffer(HEADER_BYTES, 5)[:] = b"hello"  # data the pre-faulting must leave alone
    attached = Arena.attach(arena.path, arena.size, arena.nonce)
    try:
        assert _resident_kib(attached) < arena.size // 1024 // 2  # the header page or so
        attached.prefault_in_background()
        wait_for(lambda: _resident_kib(attached) >= arena.size // 1024, "the attached arena's pages")
        assert bytes(attached.buffer(HEADER_BYTES, 5)) == b"hello"
    finally:
        attached.close()


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
    dead, live = _python("shm_arena_owner", tmp_path), _python("shm_arena_owner", tmp_path)
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
    out = _run("shm_view_in_other_process", arena.path, arena.size, arena.nonce, HEADER_BYTES + 4096)
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
    out = _run("imports_without_jax", "print", "colocar.shm")
    assert out.strip() == "[]"
