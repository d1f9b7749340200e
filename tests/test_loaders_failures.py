"""Input pipelines over lost or unmapped sidecars: batches by calls without shared memory, a
killed or hung sidecar, and a killed controller whose lent slots must be freed.
"""

from __future__ import annotations

import signal

import pytest
from helpers import program, wait_for
from loaders_helpers import (
    B,
    N,
    config,
    expected_labels,
    explode_on_seven,
    features,
    labels,
)

import colocar
from colocar import loaders


def test_batches_come_by_calls_when_the_controller_does_not_map_the_arena(grpc_cluster):
    """Without shared memory each batch is a call (its slot copied over gRPC); a 2-slot ring
    refills as each call's slot is let go in the sidecar, many times over; a bad record's error
    names batch, host and record as over a feed."""
    with loaders.load(config(prefetch=2), grpc_cluster) as it:
        assert it._fed == []
        assert [labels(b) for b in it] == [expected_labels(k) for k in range(2 * (N // B))]
    transforms = [{"kind": "map", "fn": explode_on_seven}, {"kind": "map", "fn": features}]
    with loaders.load(config(transforms=transforms, shuffle=False), grpc_cluster) as it:
        with pytest.raises(Exception, match=r"batch 0 on host0: .*record 7"):
            next(it)


def test_killed_sidecar_raises_host_lost():
    with colocar.local_cluster(hosts=2, arena_size=16 << 20, processes=0, heartbeat_seconds=0.5) as c:
        it = loaders.load(config(num_epochs=None), c)
        next(it)
        c.processes[1].kill()
        with pytest.raises(colocar.HostLostError):
            for _ in range(100):
                next(it)
        it.close()


def test_hung_sidecar_raises_host_lost():
    """A sidecar that stops answering mid-epoch (SIGSTOP) is found by the keepalives, which
    resume once its feed goes quiet: the iterator raises instead of waiting forever."""
    with colocar.local_cluster(hosts=2, arena_size=16 << 20, processes=0, heartbeat_seconds=0.5) as c:
        it = loaders.load(config(num_epochs=None), c)
        next(it)
        c.processes[1].send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(colocar.HostLostError, match="host1"):
                for _ in range(100):
                    next(it)
        finally:
            c.processes[1].kill()
        it.close()


def test_a_killed_controller_gets_its_lent_slots_freed_and_workers_stopped(make_cluster):
    """A training process killed while it holds batches (slots lent over its feed) never gives
    them back; its sidecar frees them all and stops the pipeline's workers anyway."""
    import psutil

    sidecars = make_cluster(hosts=1, persist=True)
    host = sidecars.hosts[0]
    used = lambda: host.stats()["pools"]["default"]["used"]  # noqa: E731
    baseline = used()
    controller = _holding_controller(sidecars)
    try:
        line = controller.stdout.readline()
        assert line.strip(), controller.stderr.read()[-3000:]
        workers = [int(pid) for pid in line.split()]
        assert used() > baseline and all(psutil.pid_exists(pid) for pid in workers)
        controller.kill()
        controller.wait(timeout=30)
        wait_for(lambda: used() == baseline, "the dead controller's slots to be freed")
        wait_for(lambda: not any(psutil.pid_exists(pid) for pid in workers), "its workers to stop")
    finally:
        if controller.poll() is None:
            controller.kill()
            controller.wait(timeout=30)


def _holding_controller(sidecars, *extra: str):
    import subprocess
    import sys

    host = sidecars.hosts[0]
    return subprocess.Popen(
        [sys.executable, program("loaders_holding_controller"), host.address, sidecars.token_file, *extra],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_script_ending_in_an_error_with_an_open_iterator_exits(make_cluster):
    """An uncaught error with the iterator still open: the interpreter's shutdown closes it
    without waiting on the link's threads, which no longer run then (it hung there for good)."""
    import subprocess

    import psutil

    sidecars = make_cluster(hosts=1, persist=True)
    host = sidecars.hosts[0]
    used = lambda: host.stats()["pools"]["default"]["used"]  # noqa: E731
    baseline = used()
    controller = _holding_controller(sidecars, "raise")
    try:
        workers = [int(pid) for pid in controller.stdout.readline().split()]
        try:
            _, err = controller.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail("the controller hung at interpreter shutdown with its iterator open")
        assert controller.returncode == 1 and "a bug in the training loop" in err, err[-3000:]
        wait_for(lambda: used() == baseline, "the ended controller's slots to be freed")
        wait_for(lambda: not any(psutil.pid_exists(pid) for pid in workers), "its workers to stop")
    finally:
        if controller.poll() is None:
            controller.kill()
            controller.wait(timeout=30)


def test_a_host_failing_mid_batch_does_not_pin_the_other_hosts_slot():
    """Host 1's pipeline dies after host 0 delivered its part of the batch: the error's
    traceback (kept here, with the collector off) holds none of host 0's views, so host 0's
    slot comes back at close, not at some later garbage collection. (Host 1's remote object
    stays while a traceback frame still names its handle, as any live handle keeps it.)"""
    import gc
    import os

    with colocar.local_cluster(hosts=2, arena_size=16 << 20, processes=0) as c:
        c.make_current()
        host0 = c.hosts[0]
        baseline = host0.stats()["pools"]["default"]["used"]
        it = loaders.load(config(num_epochs=None), c)
        next(it)
        os.kill(it._remote[1].worker_pids()[0], signal.SIGKILL)
        gc.disable()
        try:
            with pytest.raises(Exception, match="died") as info:
                for _ in range(100):
                    next(it)
            it.close()
            wait_for(
                lambda: host0.stats()["pools"]["default"]["used"] == baseline,
                f"host0's ring to be freed while the {info.type.__name__} is still held",
            )
        finally:
            gc.enable()
