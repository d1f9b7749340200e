"""Checkpoints when things break: sidecars killed mid-save, a trainer killed after `save`, a
writer paused past its lease, and a real GCS server (fake-gcs-server) that stops mid-save.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_helpers import MiB, abstract, assert_same, make_state
from helpers import FakeGcs, program, wait_for
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from colocar.checkpoint import CheckpointError, CheckpointManager
from colocar.checkpoint.format import layout
from colocar.checkpoint.store.catalog import steps_of
from colocar.checkpoint.store.storage import open_storage


def _kill_during_save(make_cluster, directory: str, seed: int) -> None:
    """Saves steps until a sidecar is SIGKILLed at a seeded random moment; then a fresh cluster
    restores the latest committed step bit-exactly, and never an uncommitted one."""
    rnd = random.Random(seed)
    c = make_cluster(hosts=2, arena_size=32 * MiB, lease_seconds=2)
    c.make_current()
    m = CheckpointManager(directory, c, max_chunk_bytes=256 * 1024, queue=True)
    saved = {}
    victim = c.processes[rnd.randrange(2)]
    killer = threading.Timer(rnd.uniform(0.2, 1.5), victim.kill)
    killer.start()
    try:
        with pytest.raises(CheckpointError):
            for step in range(1, 100):
                state = make_state(step, rows=512)
                m.save(step, state)
                saved[step] = jax.tree_util.tree_map(np.asarray, state)
                m.wait(timeout=60)
    finally:
        killer.cancel()
    with contextlib.suppress(CheckpointError):
        m.close()  # its lease goes (released): the reader below is no second writer
    fresh = make_cluster(hosts=2, arena_size=32 * MiB)
    reader = CheckpointManager(directory, fresh)
    latest = reader.latest_step()
    if latest is not None:
        assert latest in saved
        restored = reader.restore(target=abstract(make_state(latest, rows=512)))
        assert_same(saved[latest], jax.tree_util.tree_map(np.asarray, restored))
    for step in range(1, 100):  # every listed step restores; nothing else is listed
        if os.path.exists(os.path.join(directory, layout.step_dir(step), layout.COMMITTED)):
            assert step in reader.all_steps()
    reader.close()


def test_save_with_a_host_already_lost_leaves_no_writer_behind(make_cluster, tmp_path, cluster):
    """Host 1's sidecar is gone before a save: the save fails at once naming it, leaves no
    writer of its own behind, and closing the manager deletes its writer on host 0 (a detached
    object that would outlive the session)."""
    c = make_cluster(hosts=2, arena_size=16 * MiB)
    c.make_current()
    try:
        m = CheckpointManager(str(tmp_path / "lost"), c)
        m.save(1, make_state(1))
        m.wait()
        c.processes[1].kill()
        c.processes[1].wait()
        with pytest.raises(CheckpointError, match="save of step 2 failed: .*host1"):
            m.save(2, make_state(2))
        with pytest.raises(Exception, match="colocar.checkpoint"):
            c.hosts[0].object(f"colocar.checkpoint/{m._id}/2")
        assert m.all_steps() == [1]
        m.close()
        assert c.hosts[0].stats()["objects"] == 0
    finally:
        cluster.make_current()


def test_sidecar_killed_mid_save_keeps_the_previous_step(make_cluster, tmp_path, cluster):
    try:
        _kill_during_save(make_cluster, str(tmp_path / "kill"), seed=1)
    finally:
        cluster.make_current()


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2, 12))
def test_sidecar_killed_at_random_points(make_cluster, tmp_path, cluster, seed):
    try:
        _kill_during_save(make_cluster, str(tmp_path / "kill"), seed)
    finally:
        cluster.make_current()


@pytest.mark.parametrize("layout", ["colocar", "orbax"])
def test_trainer_killed_after_save_still_commits(make_cluster, tmp_path, cluster, layout):
    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True, lease_seconds=2)
    directory = str(tmp_path / "orphan")
    try:
        trainer = subprocess.run(
            [
                sys.executable,
                program("ckpt_trainer"),
                ",".join(h.address for h in sidecars.hosts),
                sidecars.token_file,
                directory,
                layout,
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert trainer.returncode == -signal.SIGKILL, trainer.stderr[-3000:]
        steps = steps_of(open_storage(directory), layout)
        wait_for(
            lambda: steps.is_committed(1),
            "the sidecars to commit the dead trainer's step",
            timeout=60,
        )
        sidecars.make_current()
        m = CheckpointManager(directory, sidecars)
        mesh = Mesh(np.array(jax.devices()).reshape(8), ("d",))
        target = {
            "w": jax.ShapeDtypeStruct((8 * 1024, 64), jnp.float32, sharding=NamedSharding(mesh, P("d"))),
            "note": None,
        }
        restored = m.restore(target=target)
        assert restored["note"] == "from a dead trainer"
        assert np.array_equal(np.asarray(restored["w"]).ravel(), np.arange(8 * 1024 * 64, dtype=np.float32))
        m.close()
    finally:
        cluster.make_current()


def test_lease_taken_over_from_a_paused_writer_stops_it(make_cluster, tmp_path, cluster):
    """A writer paused past its lease (SIGSTOP: a frozen VM, a long GC) loses the directory to the
    next writer and, once resumed, refuses to save instead of writing over the new one's steps."""
    sidecars = make_cluster(hosts=1, persist=True)
    directory = str(tmp_path / "paused")
    holder = subprocess.Popen(
        [
            sys.executable,
            program("ckpt_paused_writer"),
            sidecars.hosts[0].address,
            sidecars.token_file,
            directory,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ready", holder.stderr.read()[-3000:]
        holder.send_signal(signal.SIGSTOP)
        lease = os.path.join(directory, layout.WRITER_LEASE)
        wait_for(lambda: time.time() - os.path.getmtime(lease) > 2.5, "the paused writer's lease to go stale")
        sidecars.make_current()
        successor = CheckpointManager(directory, sidecars, lease_seconds=2)
        successor.save(5, {"x": np.arange(5)})
        successor.wait()
        holder.send_signal(signal.SIGCONT)
        out, err = holder.communicate("go\n", timeout=60)
        assert out.startswith("refused:") and "took over" in out, out + err[-3000:]
        assert successor.all_steps() == [1, 5]
        assert np.array_equal(successor.restore(5)["x"], np.arange(5))
        successor.close()
    finally:
        if holder.poll() is None:
            holder.send_signal(signal.SIGCONT)
            holder.kill()
            holder.wait()
        cluster.make_current()


# --- GCS (fake-gcs-server) ------------------------------------------------------------------------
@pytest.fixture
def gcs_cluster(make_cluster, gcs_server, cluster):
    """Two sidecars that reach the fake GCS server (tensorstore reads its endpoint from the env)."""
    c = make_cluster(hosts=2, arena_size=32 * MiB, env=gcs_server.env)
    c.make_current()
    yield c
    cluster.make_current()


def test_gcs_round_trip_retention_and_listing(gcs_cluster, gcs_server):
    gcs_server.create_bucket("colocar-ckpt")
    url = "gs://colocar-ckpt/run1"
    state = make_state(13)
    m = CheckpointManager(url, gcs_cluster, max_to_keep=1)
    for step in (1, 2):
        m.save(step, state)
        m.wait()
    assert m.all_steps() == [2]
    assert_same(state, m.restore(target=abstract(state)))
    m.close()
    ls = subprocess.run(
        [sys.executable, "-c", "from colocar.cli import main; main()", "ckpt", "ls", url, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert [s["step"] for s in json.loads(ls.stdout.strip().splitlines()[-1])["steps"]] == [2]


def test_gcs_server_stopped_mid_save_fails_in_bounded_time(make_cluster, tmp_path, cluster):
    server = FakeGcs(str(tmp_path))  # its own server: this test stops it
    server.start()
    try:
        with server.environment():
            server.create_bucket("colocar-stop")
            c = make_cluster(hosts=2, arena_size=32 * MiB, env=server.env)
            c.make_current()
            m = CheckpointManager("gs://colocar-stop/run", c, storage_timeout=3, max_chunk_bytes=64 * 1024)
            m.save(1, make_state(14, rows=256))
            m.wait()
            m.save(2, make_state(15, rows=65536))  # 8 MiB in 128 objects of 64 KiB
            server.stop()
            # Bounded by storage_timeout and the retries; a hang would end in TimeoutError instead.
            with pytest.raises(CheckpointError, match=r"step 2 failed: host \d.*(connect|CURL|UNAVAILABLE)"):
                m.wait(timeout=120)
            m.close()
    finally:
        server.stop()
        cluster.make_current()
