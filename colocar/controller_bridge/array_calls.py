"""Array calls in flight: staged on every host at once, started in order, results assembled.

Runs in the controller. `ArrayCallFuture` takes an `ArrayTarget` (what `@colocated` functions
and `colocated_class` methods tell it: a name, options, and how to build a host's call), plans
the call (`planner.py`), stages each host's blocks and builds its call (device-to-host copies
into the host's arena, or uploads without one; a part small enough to travel pickled in its
request is staged in ordinary memory), then starts the calls from the caller's thread in host
order, so that they keep their place in its lanes.

Staging for several hosts runs concurrently on a small shared pool; for one host, or when
every part is small, it runs inline. The first failure wins, and whatever was staged for the
other hosts goes back; an interrupt returns at once and leaves the stagings still running to
give back their blocks.
Once started, a lost host fails the call at once, and the other hosts are told to drop theirs.
Under multi-controller JAX the processes then check that their outputs agree (`processes.py`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np

from colocar.errors import HostLostError
from colocar.protocol.serialization import ARRAY_THRESHOLD
from colocar.shm import holds

from . import planner
from .calls import Call, CallFuture
from .cluster import Host
from .planner import CallPlan, HostPlan
from .processes import OutputCheck
from .specs import Options

STAGING_THREADS = 8  # hosts staged at once; their copies and RPCs release the GIL

CallBuilder = Callable[[tuple, dict], Call]


@dataclass(frozen=True)
class ArrayTarget:
    """What an array call needs of what it calls (a colocated function or method)."""

    name: str  # qualified, for messages
    label: str  # as the user calls it, for hints such as `f.specialize(...)`
    options: Options
    # Called on the caller's thread, once per host and before staging (a method creates its
    # object there); what it returns builds the host's call, possibly on a staging thread.
    bind: Callable[[Host], CallBuilder]


class ArrayCallFuture:
    """A colocated call with array semantics in flight on all its hosts."""

    def __init__(self, target: ArrayTarget, args: tuple, kwargs: dict):
        self._plan = planner.plan_call(target.name, target.label, target.options, args, kwargs)
        self._check = OutputCheck.needed(self._plan)  # numbered now: calls are started in order
        self._outcome: tuple[bool, Any] | None = None
        self._futures: list[tuple[HostPlan, CallFuture]] = []
        try:
            self._start(target)
        except BaseException as e:
            if self._check is not None:
                self._check.failed(e)
            raise

    def _start(self, target: ArrayTarget) -> None:
        builders = [target.bind(h.host) for h in self._plan.hosts]
        tasks = [_staging(self._plan, h, b) for h, b in zip(self._plan.hosts, builders, strict=True)]
        calls: list[Call] = []
        try:
            calls = stage(tasks, inline=_small(self._plan))
            for host, call in zip(self._plan.hosts, calls, strict=True):
                self._futures.append((host, call.start()))
        except BaseException:  # an interrupt, or a failure on a later host: none goes on
            self._give_up()
            for call in calls[len(self._futures) + 1 :]:  # never started (the one that raised
                call.discard()  # may have been queued: its blocks are left to the session)
            raise

    def _give_up(self) -> None:
        """After an interrupt or a lost host: the call is given up on every host (see
        `CallFuture.give_up`): cancelled on the sidecars, its late replies freed."""
        for _, future in self._futures:
            future.give_up()

    def result(self) -> Any:
        """The global result; an interrupt while waiting cancels the call on every host, and so
        does a lost host, at once (see `_wait`). Other errors are raised once all hosts ended,
        the first host's first. A call spanning several JAX processes then checks that they all
        got the same outputs (`processes.py`)."""
        if self._check is None:
            return self._result()
        if self._outcome is None:  # checked once: a second result() gives the same outcome
            self._outcome = self._checked(self._check)
        ok, value = self._outcome
        if not ok:
            raise value
        return value

    def _checked(self, check: OutputCheck) -> tuple[bool, Any]:
        try:
            result = self._result()
        except BaseException as e:
            check.failed(e)
            return False, e
        try:
            check.agree(result)
        except BaseException as e:
            return False, e
        return True, result

    def _result(self) -> Any:
        try:
            lost = self._wait()
        except BaseException:
            self._give_up()
            raise
        if lost is not None:
            self._give_up()
            raise lost
        errors = []
        results = []
        for host, future in self._futures:
            try:
                results.append((host, future.result()))
            except Exception as e:  # noqa: BLE001 - the first error is raised after all finished
                errors.append(e)
            except BaseException:
                self._give_up()
                raise
        if errors:
            raise errors[0]
        return planner.assemble(self._plan, results)

    def _wait(self) -> HostLostError | None:
        """Waits until every host's part ended, or one host is lost: then the error to raise.

        A lost host's part ends as soon as its connection knows (a reset link, a missed
        keepalive); waiting on the other hosts' parts (minutes, or forever) would only delay
        an error that is already certain, so they are given up (the caller cancels them)."""
        changed = threading.Event()
        for _, future in self._futures:
            future.add_done_callback(lambda _: changed.set())
        while True:
            changed.clear()  # before looking: a part ending after the look sets it again
            for host, future in self._futures:
                error = future.failure()
                if isinstance(error, HostLostError):
                    return self._lost(host, error)
            if all(future.done() for _, future in self._futures):
                return None
            changed.wait()

    def _lost(self, host: HostPlan, error: HostLostError) -> HostLostError:
        others = [h.host.name for h, _ in self._futures if h is not host]
        if not others:
            return error
        lost = HostLostError(
            f"{self._plan.name} failed: {error}; {', '.join(others)} were told to drop their part. "
            f"Call it again once {host.host.name} is back (the heartbeat reconnects a restarted sidecar)"
        )
        lost.__cause__ = error
        return lost


def _staging(plan: CallPlan, host: HostPlan, build: CallBuilder) -> Callable[[], Call]:
    """The host's staging: its blocks of the array arguments, then its call built on them."""

    def run() -> Call:
        if plan.options.per_device_shards:
            values: Sequence[Any] = plan.shards(host)
        else:
            values = _blocks(host.host, plan.block_specs(host))
            plan.fill(host, values)
        args, kwargs = plan.arguments(values)
        return build(args, kwargs)

    return run


def _blocks(host: Host, specs: list[tuple[tuple[int, ...], np.dtype]]) -> list[np.ndarray]:
    """Empty host blocks, straight in the sidecar's arena where `_in_arena`, else ordinary
    memory (pickled into the call's request)."""
    in_arena = [i for i, spec in enumerate(specs) if _in_arena(host, spec)]
    staged = iter(host.connection.blocks.empty([specs[i] for i in in_arena]) if in_arena else [])
    return [next(staged) if i in in_arena else np.empty(*spec) for i, spec in enumerate(specs)]


def _small(plan: CallPlan) -> bool:
    """Whether every host's staging is small enough to run in the caller's thread: each of
    its blocks is pickled into its request (see `_in_arena`), and so is every other argument,
    so it neither allocates nor uploads; a copy of a few KiB costs less than a hand-off to a
    staging thread."""
    if plan.options.per_device_shards:
        return False
    others = (leaf for i, leaf in enumerate(plan.leaves) if i not in plan.positions)
    if any(isinstance(leaf, np.ndarray) and leaf.nbytes >= ARRAY_THRESHOLD for leaf in others):
        return False
    return all(_nbytes(spec) < ARRAY_THRESHOLD for h in plan.hosts for spec in plan.block_specs(h))


def _nbytes(spec: tuple[tuple[int, ...], np.dtype]) -> int:
    shape, dtype = spec
    return math.prod(shape) * np.dtype(dtype).itemsize


def _in_arena(host: Host, spec: tuple[tuple[int, ...], np.dtype]) -> bool:
    """Whether a host's block of an argument is staged in its sidecar's arena: when this
    controller maps it, the dtype can live there (object-like ones, StringDType, cannot) and
    the block is one the request would not carry pickled anyway (`ARRAY_THRESHOLD`). A small
    one costs no Allocate round trip, nor a release later."""
    return host.connection.blocks.mapped and holds(spec[1]) and _nbytes(spec) >= ARRAY_THRESHOLD


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _staging_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=STAGING_THREADS, thread_name_prefix="colocar-staging")
        return _pool


def stage(tasks: Sequence[Callable[[], Call]], inline: bool = False) -> list[Call]:
    """Runs one staging per host and returns their calls, in order.

    One, or `inline` ones (small: see `_small`), run in this thread one after the other (no
    hand-off between threads); several run at once. If one fails, the first failure is raised
    once the others stopped, and their calls are discarded (their blocks go back); an
    interrupt raises at once, and stagings still running discard theirs when they end."""
    if len(tasks) == 1 or inline:
        calls: list[Call] = []
        try:
            for task in tasks:
                calls.append(task())
        except BaseException:
            for call in calls:
                call.discard()
            raise
        return calls
    pool = _staging_pool()
    futures: list[Future] = []
    try:
        futures.extend(pool.submit(task) for task in tasks)
        wait(futures, return_when=FIRST_EXCEPTION)
    except BaseException:
        _discard(futures)
        raise
    failed = [f for f in futures if f.done() and f.exception() is not None]
    if failed:
        try:
            for f in futures:
                f.cancel()
            wait(futures)  # the running ones end: their blocks go back before the error is seen
        finally:
            _discard(futures)
        failed[0].result()  # raises
    return [f.result() for f in futures]


def _discard(futures: Sequence[Future]) -> None:
    """The calls these stagings built (or will build) are never started: they are discarded."""
    for future in futures:
        if not future.cancel():
            future.add_done_callback(_discard_call)


def _discard_call(future: Future) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().discard()
