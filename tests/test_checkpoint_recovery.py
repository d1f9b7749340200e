"""Checkpoint failure paths that must clean up and say what happened: a failed restore frees
every block it allocated, a truncated manifest is named (and the other steps stay usable), and
a trainer process killed mid-save fails the save in every process within its session's lease.
"""

from __future__ import annotations

import glob
import json
import os
import queue
import signal
import threading
import time

import pytest
from checkpoint_helpers import MiB, abstract, assert_same, attempt_path, make_state
from helpers import wait_for
from multi_helpers import stop, two_processes

from colocar.checkpoint import CheckpointError, CheckpointManager
from colocar.checkpoint.cli import main as ckpt_main
from colocar.checkpoint.format import layout


def _used(cluster) -> list[int]:
    """Bytes leased in each host's arena, all pools."""
    return [sum(p["used"] for p in h.stats()["pools"].values()) for h in cluster.hosts]


def _flip_a_byte(directory: str, step: int, key: str) -> None:
    """Corrupts the first chunk of `key` in `step` (its checksum no longer matches)."""
    attempt = attempt_path(directory, step)
    manifest = json.load(open(os.path.join(attempt, layout.MANIFEST)))
    array = os.path.join(attempt, layout.array_dir(manifest, manifest["leaves"][key]))
    chunk = os.path.join(array, "c", "0", "0")
    data = bytearray(open(chunk, "rb").read())
    data[10] ^= 0x40
    open(chunk, "wb").write(bytes(data))


@pytest.mark.parametrize("reach", ["cluster", "grpc_cluster"])
def test_failed_restores_free_every_block_they_allocated(request, tmp_path, reach):
    """One host's read hits a corrupted chunk (DATA_LOSS) while the other's succeeds: each
    failed restore gives back the blocks of both, so the arenas return to where they were
    (with the arena mapped, and without it: gRPC)."""
    cluster = request.getfixturevalue(reach)
    state = make_state(3, rows=512)
    m = CheckpointManager(str(tmp_path / "leak"), cluster)
    try:
        m.save(1, state)
        m.wait()
        _flip_a_byte(m.directory, 1, "['params']['w']")
        baseline = _used(cluster)
        for _ in range(4):
            with pytest.raises(CheckpointError, match=r"step 1 on host 0 failed.*[Dd]igest mismatch"):
                m.restore(target=abstract(state))
        wait_for(
            lambda: all(u <= b for u, b in zip(_used(cluster), baseline, strict=True)),
            f"the arenas to return to {baseline} bytes used after the failed restores",
        )
    finally:
        m.close()


@pytest.fixture
def truncated(cluster, tmp_path):
    """Steps 1 and 2 committed; step 2's manifest cut in half (a torn or damaged object)."""
    m = CheckpointManager(str(tmp_path / "torn"), cluster)
    states = {step: make_state(step) for step in (1, 2)}
    for step, state in states.items():
        m.save(step, state)
    m.wait()
    manifest = os.path.join(attempt_path(m.directory, 2), layout.MANIFEST)
    body = open(manifest, "rb").read()
    open(manifest, "wb").write(body[: len(body) // 2])
    yield m, states
    m.close()


def test_truncated_manifest_names_the_step_and_an_older_one(truncated):
    m, states = truncated
    with pytest.raises(CheckpointError) as error:
        m.restore()
    message = str(error.value)
    assert "step 2" in message and layout.MANIFEST in message and "unreadable" in message, message
    assert "restore(step=1) picks an older one" in message, message
    with pytest.raises(CheckpointError, match=r"step 2: its manifest .*manifest\.json is unreadable"):
        m.restore(step=2)
    with pytest.raises(CheckpointError, match="restore\\(step=1\\)"):
        m.metadata()
    assert_same(m.restore(step=1, target=abstract(states[1])), states[1])


def test_ckpt_ls_marks_a_truncated_manifest_and_lists_the_others(truncated, capsys):
    m, _ = truncated
    ckpt_main(["ls", m.directory, "--json"])
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)["steps"]}
    assert rows[1]["status"] == "committed" and rows[1]["leaves"] > 0
    assert rows[2]["status"] == "unreadable (committed)" and "step 2" in rows[2]["error"]
    ckpt_main(["ls", m.directory])
    out, err = capsys.readouterr()
    assert "2 step(s)" in out and "unreadable (committed)" in out and "manifest.json is unreadable" in err
    with pytest.raises(SystemExit) as exited:
        ckpt_main(["show", m.directory, "2"])
    assert exited.value.code == 2 and "step 2: its manifest" in capsys.readouterr().err


def _lines(process) -> queue.Queue:
    """The process's output lines, read by a thread (None once it ends)."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in process.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def _next_line(lines: queue.Queue, prefixes: tuple[str, ...], deadline: float) -> str:
    """The first line starting with one of `prefixes`, or fails with what was printed."""
    seen = []
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            pytest.fail(f"no line starting with {prefixes} before the deadline: {seen[-30:]}")
        if line is None:
            pytest.fail(f"the process ended without printing {prefixes}: {seen[-30:]}")
        if line.startswith(prefixes):
            return line
        seen.append(line)


def _kill_mid_save(make_cluster, directory: str, killed: int) -> tuple[list, list[queue.Queue]]:
    """Two processes save step 3 (2 s session leases, commit_timeout 600 s); process `killed`
    is SIGKILLed once its save began on its writer, before it handed over its part."""
    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True, lease_seconds=2)
    trainers = two_processes("ckpt_multi_killed", sidecars, directory, str(killed))
    outputs = [_lines(t) for t in trainers]
    deadline = time.monotonic() + 120
    for lines in outputs:
        assert _next_line(lines, ("ready",), deadline) == "ready"
    for t in trainers:
        t.stdin.write("go\n")
        t.stdin.flush()
    _next_line(outputs[killed], ("mid-save",), deadline)
    trainers[killed].send_signal(signal.SIGKILL)
    return trainers, outputs


def test_trainer_killed_mid_save_fails_the_save_in_the_other_process(make_cluster, tmp_path, cluster):
    """Process 1 dies mid-save: its sidecar sees the session lapse and marks host 1's part
    failed, so process 0's `wait` raises naming host 1 within seconds, instead of waiting
    commit_timeout (600 s here) for a done marker that cannot come."""
    directory = str(tmp_path / "killed")
    trainers: list = []
    try:
        trainers, outputs = _kill_mid_save(make_cluster, directory, killed=1)
        result = _next_line(outputs[0], ("committed", "failed:"), time.monotonic() + 60)  # << 600 s
        assert result.startswith("failed: CheckpointError save of step 3 failed"), result
        assert "host 1: saving step 3 failed" in result and "session lapsed" in result, result
        step = os.path.join(directory, layout.step_dir(3))
        assert os.path.exists(os.path.join(attempt_path(directory, 3), layout.failed_marker(1)))
        assert not os.path.exists(os.path.join(step, layout.COMMITTED))
    finally:
        stop(trainers)
        cluster.make_current()


def test_committing_trainer_killed_mid_save_fails_its_hosts_part(make_cluster, tmp_path, cluster):
    """Process 0 dies mid-save: its sidecar, which commits, marks host 0's part failed once the
    session lapsed, instead of keeping the step alive until commit_timeout. (Process 1 is
    ended by JAX itself: jax.distributed's coordinator lived in process 0.)"""
    directory = str(tmp_path / "killed-0")
    trainers: list = []
    try:
        trainers, _ = _kill_mid_save(make_cluster, directory, killed=0)
        marker = os.path.join(directory, layout.step_dir(3), "*", layout.failed_marker(0))
        wait_for(lambda: glob.glob(marker), "host 0's failure marker", timeout=60)  # << 600 s
        assert "session lapsed" in json.load(open(glob.glob(marker)[0]))["error"]
        assert not os.path.exists(os.path.join(directory, layout.step_dir(3), layout.COMMITTED))
    finally:
        stop(trainers)
        cluster.make_current()
