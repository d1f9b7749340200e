"""Failures reach the caller as errors, never hangs or leaks: remote exceptions, bad values,
missing modules, full pools, timeouts and cancellation.

Tests that break sidecars start their own small clusters (`make_cluster`); the shared
`cluster` fixture is only used for calls that leave it as it was.
"""

from __future__ import annotations

import importlib
import sys
import threading
import uuid
from concurrent.futures import CancelledError
from typing import Any

import numpy as np
import pytest
from failures_helpers import (
    DEADLINE,
    Counter,
    CustomError,
    Holder,
    MiB,
    arena_sum,
    echo,
    make_array,
    make_lock,
    mark_and_wait,
    raise_custom,
    raise_unrebuildable,
    raise_value_error,
    raise_with_lock,
    usage,
    wait_with_timeout,
)
from helpers import sidecar_pid, wait_for

import colocar
from colocar.shm import ArenaFullError


# --- 1. remote exceptions -----------------------------------------------------------------------
def test_exception_keeps_its_type_traceback_and_host(cluster):
    host = cluster.hosts[1]
    with pytest.raises(ValueError, match="bad value 7") as info:
        raise_value_error.on(host)(7)
    e = info.value
    assert type(e) is ValueError
    assert e.colocar_host == host.name
    assert any(host.name in note for note in e.__notes__)
    remote = str(e.__cause__)
    assert "in raise_value_error" in remote and "ValueError: bad value 7" in remote
    assert host.name in remote

    future = raise_custom.on(host).submit(3)
    e = future.exception(timeout=DEADLINE)
    assert type(e) is CustomError and e.code == 3 and "custom failure 3" in str(e)
    assert e.colocar_host == host.name and "raise_custom" in str(e.__cause__)


@pytest.mark.parametrize("fn", [raise_unrebuildable, raise_with_lock], ids=["unpickle-fails", "pickle-fails"])
def test_exception_that_cannot_come_back_is_remote_error(cluster, fn):
    host = cluster.hosts[0]
    with pytest.raises(colocar.RemoteError) as info:
        fn.on(host)()
    e = info.value
    expected = "UnrebuildableError" if fn is raise_unrebuildable else "RuntimeError"
    assert e.type_name.endswith(expected)
    assert e.remote_message == ("left and right" if fn is raise_unrebuildable else "holds a lock")
    assert fn.__name__ in e.remote_traceback and expected in e.remote_traceback
    assert e.host == host.name and host.name in str(e)
    assert e.colocar_host == host.name


# --- 2. values that cannot be pickled -----------------------------------------------------------
def test_unpicklable_arguments_and_results(cluster):
    host = cluster.hosts[0]
    with pytest.raises(colocar.SerializationError, match=r"argument 1 \(<unlocked _thread.lock"):
        echo.on(host)(1, threading.Lock())
    with pytest.raises(colocar.SerializationError, match="keyword argument 'guard'"):
        echo.on(host).submit(1, guard=threading.Lock())
    with pytest.raises(colocar.SerializationError, match=r"result of .*make_lock") as info:
        make_lock.on(host)()
    assert "_thread.lock" in str(info.value)
    # the cluster keeps working, both hosts
    assert echo.on(cluster.hosts)(1, x=2) == [((1,), {"x": 2})] * 2


# --- 3. modules the sidecar cannot import -------------------------------------------------------
def test_missing_module_is_named_and_ship_modules_fixes_it(tmp_path, make_cluster):
    name = f"colocar_test_shipped_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text("def triple(x):\n    return 3 * x\n")
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp_path))  # the controller sends its sys.path at connect
    try:
        c = make_cluster()
        host = c.hosts[0]
        plain = colocar.colocated(module.triple)
        with pytest.raises(Exception, match=name) as info:
            plain.on(host)(2)
        assert "ship_modules" in str(info.value)
        assert info.value.colocar_host == host.name
        shipped = colocar.colocated(module.triple, ship_modules=[module])
        assert shipped.on(host)(2) == 6
        with pytest.raises(Exception, match=name):  # the failed load was not cached as a success
            plain.on(host)(2)
    finally:
        sys.modules.pop(name, None)


# --- 8. full pools ------------------------------------------------------------------------------
def test_full_pool_waits_then_explains(make_cluster):
    c = make_cluster(arena_size=16 * MiB, pools={"ckpt": 4 * MiB}, alloc_timeout=1)
    host = c.hosts[0]
    conn = host.connection
    assert conn.blocks.alloc_timeout == 1
    reserved = host.stats()["pools"]["default"]["reserved"]
    assert 8 * MiB < reserved < 12 * MiB

    # controller-side allocation in the default pool
    (big,) = conn.blocks.empty([((8 * MiB,), np.uint8)])
    big[:] = 5
    with pytest.raises(ArenaFullError) as info:
        conn.blocks.empty([((8 * MiB,), np.uint8)])
    message = str(info.value)
    assert "'default'" in message and "Release" in message and host.name in message
    # a call whose argument needs room also fails cleanly
    with pytest.raises(ArenaFullError, match="'default'"):
        arena_sum.on(host)(np.ones(8 * MiB, np.uint8))

    # sidecar-side allocation in the ckpt pool
    hog = Holder.on(host)(3 * MiB, "ckpt")
    with pytest.raises(ArenaFullError) as info:
        hog.grab(3 * MiB, "ckpt")
    assert "'ckpt'" in str(info.value) and "raise the size of pool 'ckpt'" in str(info.value)
    assert info.value.colocar_host == host.name
    # a full ckpt pool does not stop default-pool calls (once the default pool has room)
    del big
    wait_for(lambda: usage(host)[2] == 0, "the controller's block to be released")
    assert arena_sum.on(host)(np.ones(4 * MiB, np.uint8)) == 4 * MiB
    out = make_array.on(host)(2 * MiB, 9)
    assert out.shape == (2 * MiB,) and int(out[-1]) == 9
    del out

    # a waiting allocation gets the room freed while it waits
    conn.blocks.alloc_timeout = DEADLINE
    (first,) = conn.blocks.empty([((8 * MiB,), np.uint8)])
    box: list[Any] = []
    waiter = threading.Thread(
        target=lambda: box.append(conn.blocks.empty([((6 * MiB,), np.uint8)])), daemon=True
    )
    waiter.start()
    del first
    waiter.join(DEADLINE)
    assert box and box[0][0].nbytes == 6 * MiB
    box.clear()

    # nothing is corrupted, and after freeing, ckpt allocations work again
    assert hog.check()
    with pytest.raises(ArenaFullError, match="'ckpt'"):
        make_array.on(host)(3 * MiB, 4, pool="ckpt")
    hog.drop()
    out = make_array.on(host)(3 * MiB, 4, pool="ckpt")
    assert out.shape == (3 * MiB,) and int(out[0]) == int(out[-1]) == 4
    assert host.stats()["pools"]["ckpt"]["used"] >= 3 * MiB
    del out
    assert hog.grab(MiB, "ckpt") == 1 and hog.check()


# --- 9. timeouts and cancellation ---------------------------------------------------------------
def test_per_call_timeout(cluster, tmp_path):
    host = cluster.hosts[0]
    started, stop = tmp_path / "started", tmp_path / "stop"
    try:
        with pytest.raises(colocar.CallTimeoutError) as info:
            wait_with_timeout.on(host)(str(started), str(stop))
        assert isinstance(info.value, TimeoutError) and host.name in str(info.value)
        assert started.exists()
    finally:
        stop.touch()  # lets the remote function end
    assert sidecar_pid.on(host)() > 0


def test_cancel_queued_call(cluster, tmp_path):
    host = cluster.hosts[1]
    counter = Counter.on(host)()
    started, stop = tmp_path / "started", tmp_path / "stop"
    try:
        slow = mark_and_wait.on(host).submit(str(started), str(stop))
        queued = counter.bump.submit()
        after = counter.value.submit()  # program order: sent after `queued` would have completed
        wait_for(started.exists, "the slow call to start")
        assert queued.cancel() is True
    finally:
        stop.touch()
    assert slow.result(DEADLINE) is True
    assert after.result(DEADLINE) == 0
    with pytest.raises(CancelledError):
        queued.result(DEADLINE)
    assert counter.bump() == 1
