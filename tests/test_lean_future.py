"""The calls' future keeps `concurrent.futures.Future`'s semantics (it replaced it for speed):
each test below holds for the standard future too, and runs against both."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError, Future, InvalidStateError

import pytest

from colocar.controller_bridge.lean_future import LeanFuture

KINDS = pytest.mark.parametrize("make", [LeanFuture, Future], ids=["lean", "standard"])


@KINDS
def test_a_result_set_in_another_thread_wakes_the_waiter(make):
    future = make()
    assert future.set_running_or_notify_cancel() and future.running() and not future.done()
    timer = threading.Timer(0.2, future.set_result, (41,))
    timer.start()
    assert future.result(timeout=30) == 41  # waits: the result comes later
    assert future.done() and not future.cancelled() and future.exception() is None
    with pytest.raises(InvalidStateError):  # settled once
        future.set_result(42)
    with pytest.raises(InvalidStateError):
        future.set_exception(ValueError())
    assert future.result() == 41


@KINDS
def test_an_exception_is_raised_by_result_and_returned_by_exception(make):
    future = make()
    error = ValueError("boom")
    future.set_exception(error)
    with pytest.raises(ValueError, match="boom") as raised:
        future.result()
    assert raised.value is error and future.exception() is error


@KINDS
def test_waiting_past_the_timeout_raises_and_a_later_result_still_arrives(make):
    future = make()
    with pytest.raises(TimeoutError):
        future.result(timeout=0.05)
    with pytest.raises(TimeoutError):
        future.exception(timeout=0)
    future.set_result("late")
    assert future.result(timeout=0) == "late"


@KINDS
def test_cancel_only_before_running_and_a_cancelled_future_never_runs(make):
    queued, running = make(), make()
    assert queued.cancel() and queued.cancel() and queued.cancelled() and queued.done()
    assert not queued.set_running_or_notify_cancel()
    with pytest.raises(CancelledError):
        queued.result()
    with pytest.raises(CancelledError):
        queued.exception()
    with pytest.raises(InvalidStateError):
        queued.set_result(1)
    running.set_running_or_notify_cancel()
    assert not running.cancel() and not running.cancelled()
    with pytest.raises(RuntimeError):
        running.set_running_or_notify_cancel()


@KINDS
def test_callbacks_run_once_when_done_or_at_once_if_done(make):
    future, seen = make(), []
    future.add_done_callback(lambda f: seen.append(("before", f.result())))
    future.add_done_callback(lambda f: 1 / 0)  # logged; the others still run
    future.add_done_callback(lambda f: seen.append(("second", f.result())))
    assert seen == []
    future.set_result(7)
    future.add_done_callback(lambda f: seen.append(("after", f.result())))
    assert seen == [("before", 7), ("second", 7), ("after", 7)]
    cancelled = make()
    cancelled.add_done_callback(lambda f: seen.append(("cancelled", f.cancelled())))
    cancelled.cancel()
    assert seen[-1] == ("cancelled", True)


@KINDS
def test_many_waiters_all_wake(make):
    future, results = make(), []
    threads = [threading.Thread(target=lambda: results.append(future.result(timeout=30))) for _ in range(8)]
    for thread in threads:
        thread.start()
    future.set_result("all")
    for thread in threads:
        thread.join(timeout=30)
    assert results == ["all"] * 8
