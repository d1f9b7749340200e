"""Multi-controller checkpoints: two JAX processes (jax.distributed on CPU), each with its own
sidecar, save and restore together, and fail together when one side breaks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_helpers import MiB, attempt_path, make_state
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from multi_helpers import stop, two_processes

from colocar.checkpoint import CheckpointManager
from colocar.checkpoint.format import layout


def test_multi_controller_save_and_restore(make_cluster, tmp_path, cluster):
    """Two JAX processes (jax.distributed on CPU), each with its own sidecar: each writes the
    shards it holds, process 0's sidecar commits, each restores only its devices' slices."""
    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True)
    directory = str(tmp_path / "multi")
    trainers = two_processes("ckpt_multi_controller", sidecars, directory)
    try:
        outputs = [t.communicate(timeout=240)[0] for t in trainers]
        for t, out in zip(trainers, outputs, strict=True):
            assert t.returncode == 0 and "OK" in out, out[-3000:]
        step = attempt_path(directory, 3)
        assert sorted(os.listdir(os.path.join(step, layout.DONE_DIR))) == ["host_0.json", "host_1.json"]
        assert json.load(open(os.path.join(step, layout.MANIFEST)))["hosts"] == [0, 1]
        for out in outputs:  # each process read about half of `w` (its devices' slices)
            read = json.loads(out.split("OK", 1)[1].strip().splitlines()[0])
            assert 0 < sum(read.values()) < 64 * 16 * 4 + 64 * 1024
        reader = CheckpointManager(directory, cluster.make_current())
        mesh = Mesh(np.array(jax.devices()).reshape(8), ("d",))
        whole = reader.restore(
            target={"w": jax.ShapeDtypeStruct((64, 16), jnp.float32, sharding=NamedSharding(mesh, P("d")))}
        )
        assert np.array_equal(np.asarray(whole["w"]), np.arange(64 * 16, dtype=np.float32).reshape(64, 16))
    finally:
        stop(trainers)
        cluster.make_current()


def test_multi_controller_save_with_process_0s_sidecar_lost_fails_everywhere(make_cluster, tmp_path, cluster):
    """Process 0's sidecar (the one that commits) is gone: process 0's save fails at once, and
    process 1's `wait` fails too (a failure marker, or at the latest `commit_timeout` after its
    own part is durable) instead of waiting forever for a commit that cannot come."""
    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True)
    directory = str(tmp_path / "multi-lost")
    trainers = two_processes("ckpt_multi_saves", sidecars, directory, "3,4", "all")
    try:
        outputs = _run_after_ready(trainers, sidecars.processes[0].kill)
        for out in outputs:
            for step in (3, 4):
                assert f"failed: {step} CheckpointError" in out, out[-3000:]
        assert "host0" in outputs[0]  # the lost sidecar, named
        assert "host0" in outputs[1] or "commit" in outputs[1], outputs[1][-3000:]
        for step in (3, 4):
            assert not os.path.exists(os.path.join(directory, layout.step_dir(step), layout.COMMITTED))
    finally:
        stop(trainers)
        cluster.make_current()


def test_multi_controller_save_refused_to_process_0_fails_every_process(make_cluster, tmp_path, cluster):
    """Another job holds the directory's lease: process 0 is refused before its save starts, and
    process 1, waiting for process 0's attempt id, hears of it at once instead of timing out."""
    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True)
    directory = str(tmp_path / "multi-refused")
    other_job = CheckpointManager(directory, cluster)
    other_job.save(1, make_state(1))
    other_job.wait()
    trainers = two_processes("ckpt_multi_saves", sidecars, directory, "3", "all")
    try:
        outputs = _run_after_ready(trainers)
        assert "cannot save yet" in outputs[0].split("failed:")[0]  # told when the manager was made
        assert "failed: 3 CheckpointError" in outputs[0] and "another CheckpointManager" in outputs[0], (
            outputs[0]
        )
        assert "process 0 could not start the save of step 3" in outputs[1], outputs[1][-3000:]
        assert "another CheckpointManager" in outputs[1]
    finally:
        stop(trainers)
        other_job.close()
        cluster.make_current()


def test_multi_controller_process_0_never_saving_times_out_in_the_others(make_cluster, tmp_path, cluster):
    """Process 0 skips a save the others make (a bug in the training loop): they wait for its
    attempt id at most `commit_timeout`, then raise saying so, instead of hanging."""
    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True)
    directory = str(tmp_path / "multi-skipped")
    trainers = two_processes("ckpt_multi_saves", sidecars, directory, "3", "1")  # only process 1 saves
    try:
        outputs = _run_after_ready(trainers)
        assert "failed: 3 CheckpointError" in outputs[1], outputs[1][-3000:]
        assert "process 0 did not start its save of step 3 within commit_timeout (5 s)" in outputs[1]
        assert not os.path.exists(os.path.join(directory, layout.step_dir(3)))  # nothing was written
    finally:
        stop(trainers)
        cluster.make_current()


def test_multi_controller_commit_never_coming_times_out_in_the_others(make_cluster, tmp_path, cluster):
    """Process 0's sidecar, which commits, hangs (SIGSTOP) after process 0's save returned:
    process 1's `wait` raises `commit_timeout` after its own part is durable instead of
    waiting forever for a commit marker that nobody writes."""
    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True)
    directory = str(tmp_path / "multi-wedged")
    trainers = two_processes("ckpt_multi_wedged", sidecars, directory)
    wedged = sidecars.processes[0]
    try:
        saved = trainers[0].stdout.readline().strip()
        if saved != "saved":
            trainers[1].kill()
            pytest.fail(f"process 0 did not save: {saved}{trainers[0].communicate(timeout=60)[0][-3000:]}")
        wedged.send_signal(signal.SIGSTOP)
        for t in trainers:
            t.stdin.write("go\n")
            t.stdin.flush()
        out = trainers[1].communicate(timeout=120)[0]
        expected = "failed: CheckpointError step 3 was not committed within commit_timeout (5 s)"
        assert expected in out, out[-3000:]
        assert "is process 0 alive?" in out
        step = attempt_path(directory, 3)
        assert os.listdir(os.path.join(step, layout.DONE_DIR)) == ["host_1.json"]  # its part is durable
        assert not os.path.exists(os.path.join(directory, layout.step_dir(3), layout.COMMITTED))
        wedged.kill()  # a host that hung stays out: the step is never committed
        assert trainers[0].wait(timeout=120) == 0
    finally:
        wedged.send_signal(signal.SIGCONT)
        stop(trainers)
        cluster.make_current()


def _run_after_ready(trainers: list[subprocess.Popen], meanwhile=None) -> list[str]:
    """Waits until every process printed "ready", runs `meanwhile`, lets them all go at once
    (each one's exit waits for the other: jax.distributed) and returns their output (with
    what they printed before "ready", such as warnings)."""
    before = []
    for t in trainers:
        lines = []
        while (line := t.stdout.readline()) and line.strip() != "ready":
            lines.append(line)
        assert line, "".join(lines)[-3000:]
        before.append("".join(lines))
    if meanwhile is not None:
        meanwhile()
    for t in trainers:
        t.stdin.write("go\n")
        t.stdin.flush()
    return [b + t.communicate(timeout=120)[0] for b, t in zip(before, trainers, strict=True)]
