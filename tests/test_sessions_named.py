"""Sessions that outlive their controller: named sessions, their grace period and takeover, and
the arrays a controller still holds when its session ends (they never change).

A controller process (`programs/session_holder.py`) holds a named object, an unnamed one, a
kept result and a loader on a persistent sidecar; the tests kill it, pause it past its lease,
or take its session over, and check what survives, what is freed, and what the old
controller is told.
"""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import program, wait_for

import colocar

MiB = 1 << 20


@colocar.colocated
def filled(nbytes, value):

    out = colocar.shm.empty((nbytes,), np.uint8)
    out[:] = value
    return out


def _holder(sidecar, name: str, grace: float = 0.0, lease: float = 2.0) -> tuple[subprocess.Popen, int]:
    """A session_holder controller on `sidecar`'s host, ready; and the bytes its session holds."""
    argv = [sys.executable, program("session_holder"), sidecar.hosts[0].address, sidecar.token_file]
    child = subprocess.Popen(
        [*argv, name, str(grace), str(lease)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    line = child.stdout.readline()  # type: ignore[union-attr]
    assert line.startswith("READY"), line
    return child, int(line.split()[1])


def _sessions(sidecar) -> dict[str, dict]:
    with colocar.connect([sidecar.hosts[0].address], token_file=sidecar.token_file, devices=[[]]) as c:
        from colocar.protocol import colocar_pb2 as pb

        reply = c.hosts[0].connection.unary("ListSessions", pb.Empty(), 10)
    return {
        s.name: {"attached": s.attached, "objects": s.objects, "bytes": s.arena_bytes} for s in reply.sessions
    }


def _used(sidecar) -> int:
    return sidecar.hosts[0].stats()["pools"]["default"]["used"]


def _connect(sidecar, **kwargs) -> colocar.Cluster:
    return colocar.connect([sidecar.hosts[0].address], token_file=sidecar.token_file, **kwargs)


def test_a_new_controller_takes_the_session_over_with_its_named_objects(make_cluster):
    sidecar = make_cluster(persist=True)
    child, held = _holder(sidecar, "exp1")
    assert held >= MiB and _sessions(sidecar)["exp1"]["objects"] >= 3  # counter, unnamed, loader
    child.kill()  # a kernel restart, an OOM kill: nothing said goodbye
    child.wait()
    with _connect(sidecar, session="exp1") as c:
        assert set(c.took_over.values()) == {
            f"{sidecar.hosts[0].connection.session.info.hostname}:{child.pid}"
        }
        assert c.object("counter").add(1) == 11  # the named object is there, as it was
        session = _sessions(sidecar)["exp1"]
        assert session["objects"] == 1  # the unnamed object and the loader went with the old one
        wait_for(lambda: _used(sidecar) == 0, "the old controller's arrays and slots to be freed")
        with pytest.raises(colocar.ObjectNotFoundError, match="holds an object named 'nothing'"):
            c.object("nothing")


def test_a_taken_over_controller_is_told_and_its_arrays_never_change(make_cluster):
    sidecar = make_cluster(persist=True)
    first = _connect(sidecar, session="s")
    kept = filled.on(first.hosts[0])(MiB, 1)
    second = _connect(sidecar, session="s")  # the same process takes its session over
    try:
        with pytest.raises(colocar.SessionEndedError, match="taken over by controller"):
            filled.on(first.hosts[0])(8, 2)
        first.close()  # (or dropped, as a notebook cell run again drops it)
        new = [filled.on(second.hosts[0])(MiB, 9) for _ in range(8)]  # the arena's other blocks
        assert (kept == 1).all()
        assert _used(sidecar) >= 9 * MiB
        del new, kept
        gc.collect()
        wait_for(lambda: _used(sidecar) == 0, "the old session's block to go with its last array")
    finally:
        first.close()
        second.close()


def test_arrays_kept_after_close_never_change(make_cluster):
    sidecar = make_cluster(persist=True)
    first = _connect(sidecar)
    kept = filled.on(first.hosts[0])(MiB, 1)
    first.close()
    with _connect(sidecar) as second:
        refill = [filled.on(second.hosts[0])(MiB, 9) for _ in range(12)]
        assert (kept == 1).all()
        del refill, kept
        gc.collect()
        wait_for(lambda: _used(sidecar) == 0, "the closed session's block to go with its last array")


def test_a_named_session_outlives_its_controller_for_its_grace_then_frees_everything(make_cluster):
    sidecar = make_cluster(persist=True)
    child, held = _holder(sidecar, "short", grace=2.0, lease=1.0)
    child.kill()
    child.wait()
    wait_for(lambda: not _sessions(sidecar)["short"]["attached"], "the session to be detached")
    assert _used(sidecar) >= held  # kept for a controller that comes back
    wait_for(lambda: "short" not in _sessions(sidecar), "the grace to run out", timeout=60)
    wait_for(lambda: _used(sidecar) == 0, "everything it held to be freed")
    with _connect(sidecar, session="short") as c:
        assert c.took_over == {}
        with pytest.raises(colocar.ObjectNotFoundError):
            c.object("counter")


def test_a_controller_back_within_the_grace_finds_its_session_as_it_was(make_cluster):
    """A laptop that slept past its lease: the session was detached, not ended."""
    sidecar = make_cluster(persist=True)
    child, _ = _holder(sidecar, "nap", lease=1.0)
    try:
        child.send_signal(signal.SIGSTOP)
        wait_for(lambda: not _sessions(sidecar)["nap"]["attached"], "the lease to run out")
        time.sleep(1.0)  # well past it
        child.send_signal(signal.SIGCONT)
        child.stdin.write("check\n")  # type: ignore[union-attr]
        child.stdin.flush()  # type: ignore[union-attr]
        line = child.stdout.readline()  # type: ignore[union-attr]
        assert line.split(maxsplit=4) == ["CHECK", "11", "True", "101", f"{list(range(8, 16))}\n"], line
        assert _sessions(sidecar)["nap"]["attached"]
    finally:
        child.send_signal(signal.SIGCONT)
        child.kill()
        child.wait()


def test_a_loader_whose_session_was_taken_over_says_how_to_go_on(make_cluster):
    sidecar = make_cluster(persist=True)
    first = _connect(sidecar, session="ld")
    it = colocar.loaders.load({"source": {"kind": "range", "n": 1 << 16}, "global_batch_size": 8}, first)
    next(it)
    second = _connect(sidecar, session="ld")
    try:
        with pytest.raises(colocar.SessionEndedError, match=r"colocar\.loaders\.load\(config, cluster"):
            for _ in range(1 << 13):  # the batches already on their way come first
                next(it)
    finally:
        it.close()
        first.close()
        second.close()


def test_session_names_are_checked():
    with pytest.raises(ValueError, match="session name"):
        colocar.connect(["127.0.0.1:1"], session="two words")
    with pytest.raises(ValueError, match="named session"):
        colocar.connect(["127.0.0.1:1"], grace_seconds=5)
