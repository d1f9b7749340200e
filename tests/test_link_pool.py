"""The local link's pool of reader threads (`controller_bridge/link_pool.py`), with jobs of
the pool's `Job` shape (a `LinkReply` is one: `run_pooled`, or `cancel` at close)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import CancelledError

import pytest

from colocar.controller_bridge.link_pool import LinkPool


class LinkJob:
    """Runs `run` on a pool thread and tells `done` its outcome, or CancelledError."""

    def __init__(self, run: Callable[[], object], done: Callable[[object, BaseException | None], None]):
        self._run, self._done = run, done

    def run_pooled(self) -> None:
        try:
            reply = self._run()
        except Exception as e:  # noqa: BLE001
            self._done(None, e)
        else:
            self._done(reply, None)

    def cancel(self) -> None:
        self._done(None, CancelledError())


def test_jobs_get_a_thread_each_up_to_the_size_and_close_cancels_the_queued() -> None:
    """Two jobs that wait run at once on a pool of two; a third queues behind them; closing
    cancels the queued one (its `done` hears CancelledError), lets the running ones finish,
    and refuses new jobs."""
    pool = LinkPool(2, "test")
    release, started = threading.Event(), threading.Semaphore(0)
    outcomes: list[tuple[object, BaseException | None]] = []
    ended = threading.Semaphore(0)

    def done(reply: object, error: BaseException | None) -> None:
        outcomes.append((reply, error))
        ended.release()

    def waits() -> str:
        started.release()
        release.wait(10)
        return "ran"

    for _ in range(2):
        pool.submit(LinkJob(waits, done))
    assert started.acquire(timeout=10) and started.acquire(timeout=10)  # both run at once
    pool.submit(LinkJob(lambda: "queued", done))
    pool.close()
    assert ended.acquire(timeout=10)
    assert outcomes[0][0] is None and isinstance(outcomes[0][1], CancelledError)
    release.set()
    assert ended.acquire(timeout=10) and ended.acquire(timeout=10)
    assert sorted(str(reply) for reply, _ in outcomes[1:]) == ["ran", "ran"]
    with pytest.raises(RuntimeError):
        pool.submit(LinkJob(lambda: None, done))


def test_a_failing_job_reports_its_error_and_idle_threads_are_reused() -> None:
    pool = LinkPool(4, "test")
    outcomes: list[BaseException | None] = []
    ended = threading.Semaphore(0)

    def done(_: object, error: BaseException | None) -> None:
        outcomes.append(error)
        ended.release()

    def fails() -> None:
        raise ValueError("no")

    for _ in range(20):
        pool.submit(LinkJob(fails, done))
        assert ended.acquire(timeout=10)
    assert all(isinstance(e, ValueError) for e in outcomes) and len(outcomes) == 20
    names = {t.name for t in threading.enumerate() if t.name.startswith("colocar-link-test_")}
    assert 1 <= len(names) <= 4
    pool.close()
