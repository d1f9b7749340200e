"""Checkpoints: real sidecars writing zarr3 through tensorstore to a local disk, restores with
resharding, retention, corruption, leases, back-pressure, preemption and the `ckpt` command.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from checkpoint_helpers import MiB, abstract, assert_same, attempt_path, make_state
from helpers import wait_for
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from colocar.checkpoint import CheckpointError, CheckpointManager
from colocar.checkpoint.format import layout


@pytest.fixture
def mngr(cluster, tmp_path):
    m = CheckpointManager(str(tmp_path / "ckpt"), cluster, stale_seconds=0.5)
    yield m
    m.close()


def test_round_trip_of_every_dtype(cluster, mngr):
    mesh = cluster.mesh(("data", "model"), (4, 2))
    sharded = NamedSharding(mesh, P("data"))
    rng = np.random.default_rng(1)
    arrays = {}
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "uint8",
        "uint16",
        "uint32",
        "float16",
        "bfloat16",
        "float32",
        "complex64",
        "float8_e4m3fn",
    ):
        dtype = np.dtype(getattr(ml_dtypes, name, None) or name)
        value = rng.integers(0, 256, size=(16, 6 * dtype.itemsize), dtype=np.uint8).view(dtype)
        if name == "bool":
            value = rng.integers(0, 2, size=(16, 6)).astype(bool)
        arrays[name] = jax.device_put(value, sharded)
    state = {
        "arrays": arrays,
        "scalar": jax.device_put(jnp.float32(2.5), NamedSharding(mesh, P())),
        "keys": jax.device_put(jax.random.split(jax.random.key(7), 8), sharded),
        "rbg": jax.random.key(3, impl="rbg"),
        "host": {"int64": np.arange(10, dtype=np.int64), "float64": np.linspace(0, 1, 7)},
        "empty": jax.device_put(jnp.zeros((0, 3)), NamedSharding(mesh, P())),
        "values": [1, 2.5, "text", True, None],
    }
    mngr.save(1, state, metadata={"run": "dtypes"})
    mngr.wait()
    assert mngr.all_steps() == [1] and mngr.metadata(1) == {"run": "dtypes"}
    restored = mngr.restore(target=abstract(state))
    assert_same(state, restored)
    assert restored["arrays"]["bfloat16"].sharding == sharded
    plain = mngr.restore(1)  # no target: the saved shardings, plain containers
    assert_same(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(plain))
    assert isinstance(plain["host"]["int64"], np.ndarray)


@pytest.mark.parametrize("layout_name", ["colocar", "orbax"])
def test_resharded_restore_to_fewer_devices_and_another_mesh(cluster, mngr, make_cluster, layout_name):
    rows = 4096  # 512 KiB; small outer and inner chunks make the read accounting visible
    state = make_state(3, rows=rows)
    m = CheckpointManager(
        mngr.directory, cluster, max_chunk_bytes=64 * 1024, stale_seconds=0.5, layout=layout_name
    )
    m.save(5, state)
    m.wait()
    m.close()
    one_host = make_cluster(hosts=1, devices=jax.devices()[:4], arena_size=16 * MiB)
    try:
        reader = CheckpointManager(mngr.directory, one_host)
        for shape, spec in (((4, 1), P("a", None)), ((2, 2), P(None, ("a", "b")))):
            mesh = Mesh(np.array(jax.devices()[:4]).reshape(shape), ("a", "b"))
            target = {
                "params": {
                    "w": jax.ShapeDtypeStruct((rows, 32), jnp.float32, sharding=NamedSharding(mesh, spec))
                }
            }
            restored = reader.restore(target=target)
            w = restored["params"]["w"]
            assert w.sharding == target["params"]["w"].sharding
            assert np.asarray(w).tobytes() == np.asarray(state["params"]["w"]).tobytes()
            stats = reader.stats()["restore"]
            entry = reader.catalog.committed_manifest(5)[1]
            inner = entry["leaves"]["['params']['w']"]["inner_chunks"]
            inner_bytes = int(np.prod(inner)) * 4
            # Its slices, plus at most one inner chunk per boundary, plus shard indexes and metadata.
            slack = 8 * inner_bytes + 64 * 1024
            assert stats["bytes_needed"][0] == rows * 32 * 4
            assert stats["bytes_read"][0] <= stats["bytes_needed"][0] + slack
        reader.close()
    finally:
        cluster.make_current()


def test_partial_restore_and_mismatches_name_the_key(cluster, mngr):
    state = make_state(4)
    mngr.save(2, state)
    mngr.wait()
    part = mngr.restore(target={"params": {"w": abstract(state)["params"]["w"]}})
    assert np.array_equal(np.asarray(part["params"]["w"]), np.asarray(state["params"]["w"]))
    assert mngr.restore(keys=["data"]) == {"data": state["data"]}
    w = state["params"]["w"]
    with pytest.raises(CheckpointError, match=r"\['params'\]\['w'\].*bfloat16.*float32\[64, 32\]"):
        mngr.restore(
            target={"params": {"w": jax.ShapeDtypeStruct(w.shape, jnp.bfloat16, sharding=w.sharding)}}
        )
    with pytest.raises(CheckpointError, match=r"\['params'\]\['w'\]: the target has shape \[64, 16\]"):
        mngr.restore(
            target={"params": {"w": jax.ShapeDtypeStruct((64, 16), jnp.float32, sharding=w.sharding)}}
        )
    with pytest.raises(CheckpointError, match=r"\['nope'\]: not in step 2"):
        b = state["params"]["b"]
        mngr.restore(target={"nope": jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=b.sharding)})
    with pytest.raises(CheckpointError, match="step 9 is not a committed checkpoint"):
        mngr.restore(9)


def test_retention_listing_and_delete(cluster, tmp_path):
    state = make_state(5)
    objects = [h.stats()["objects"] for h in cluster.hosts]
    m = CheckpointManager(str(tmp_path / "keep"), cluster, max_to_keep=2, keep_period=4)
    for step in range(1, 8):
        m.save(step, state)
    m.wait()
    # One long-lived writer per host serves every save (not one per save), deleted by close().
    assert [h.stats()["objects"] for h in cluster.hosts] == [n + 1 for n in objects]
    assert m.all_steps() == [4, 6, 7] and m.latest_step() == 7
    m.delete(6)
    assert m.all_steps() == [4, 7]
    assert not os.path.exists(tmp_path / "keep" / layout.step_dir(6))
    assert_same(state, m.restore(4, target=abstract(state)))
    with pytest.raises(CheckpointError, match="step 7 already exists"):
        m.save(7, state)
    assert m.save(9, state) and not CheckpointManager(
        str(tmp_path / "x"), cluster, save_interval_steps=2
    ).save(3, state)
    m.close()
    assert [h.stats()["objects"] for h in cluster.hosts] == objects  # the writers are gone


def test_a_save_costs_one_begin_write_and_wait_per_host(cluster, mngr):
    """The manager's writers outlive a save and `wait` is a long-poll: a steady-state save of
    a tree with shards on both hosts costs each sidecar three calls: `begin`, one `write` that
    also gives the total, and one `wait` that returns when the host's part ended."""
    mngr.save(1, make_state(1))  # the first save makes the writers
    mngr.wait()
    calls = sum(h.stats()["calls"] for h in cluster.hosts)
    mngr.save(2, make_state(2))
    mngr.wait()
    assert sum(h.stats()["calls"] for h in cluster.hosts) - calls == 2 * 3
    assert mngr.all_steps() == [1, 2]


def test_uncommitted_steps_are_never_restored_and_debris_is_removed(cluster, mngr):
    state = make_state(6)
    mngr.save(1, state)
    mngr.wait()
    # A crashed save: everything but the commit marker.
    root = mngr.directory
    src, crashed = os.path.join(root, layout.step_dir(1)), os.path.join(root, layout.step_dir(2))
    subprocess.run(["cp", "-r", src, crashed], check=True)
    os.remove(os.path.join(crashed, layout.COMMITTED))
    assert mngr.all_steps() == [1] and mngr.latest_step() == 1
    with pytest.raises(CheckpointError, match="step 2 is not a committed"):
        mngr.restore(2)
    time.sleep(0.6)  # older than stale_seconds: debris
    mngr.save(3, state)
    mngr.wait()
    assert not os.path.exists(crashed)
    assert mngr.all_steps() == [1, 3]


def test_flipped_byte_and_missing_chunk_give_clear_errors(cluster, mngr):
    state = make_state(7)
    mngr.save(1, state)
    mngr.wait()
    manifest = json.load(open(os.path.join(attempt_path(mngr.directory, 1), "manifest.json")))
    array = os.path.join(attempt_path(mngr.directory, 1), "arrays", "params", "w")
    assert layout.array_dir(manifest, manifest["leaves"]["['params']['w']"]) == "arrays/params/w"
    chunk = os.path.join(array, "c", "0", "0")
    data = bytearray(open(chunk, "rb").read())
    data[10] ^= 0x40
    open(chunk, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=r"host \d.*[Dd]igest mismatch"):
        mngr.restore(target=abstract(state))
    os.remove(chunk)
    with pytest.raises(CheckpointError, match=r"c/0/0.*missing|missing.*c/0/0"):
        mngr.restore(target=abstract(state))


def test_second_writer_is_refused(cluster, tmp_path):
    state = make_state(8)
    first = CheckpointManager(str(tmp_path / "two"), cluster)
    second = CheckpointManager(str(tmp_path / "two"), cluster)
    first.save(1, state)
    with pytest.raises(CheckpointError, match="being written by another CheckpointManager"):
        second.save(2, state)
    first.close()  # releases the lease
    second.save(2, state)
    second.close()
    assert second.all_steps() == [1, 2]


def test_stale_lease_of_a_dead_writer_is_taken_over(cluster, tmp_path):
    directory = tmp_path / "stale"
    directory.mkdir()
    lease = directory / layout.WRITER_LEASE
    lease.write_text(json.dumps({"owner": "dead", "hostname": "gone", "pid": 1}))
    os.utime(lease, (time.time() - 120, time.time() - 120))  # older than lease_seconds
    m = CheckpointManager(str(directory), cluster, lease_seconds=60)
    m.save(1, make_state(16))
    assert json.loads(lease.read_text())["owner"] != "dead"
    m.close()
    assert m.all_steps() == [1] and json.loads(lease.read_text())["released"]  # released at close


@pytest.mark.parametrize("layout_name", ["colocar", "orbax"])
def test_arena_smaller_than_the_checkpoint_applies_backpressure(make_cluster, tmp_path, cluster, layout_name):
    """Host memory stays bounded by the arena: a save of 4x the arena's size goes through,
    the writers freeing blocks as their chunks become durable."""
    small = make_cluster(hosts=2, arena_size=8 * MiB, processes=1)
    mesh = small.mesh(("data",), (8,))
    big = jax.device_put(
        np.random.default_rng(9).standard_normal((8 * 256, 4096), np.float32),
        NamedSharding(mesh, P("data")),
    )  # 32 MiB: 16 MiB per host's 8 MiB arena
    try:
        m = CheckpointManager(str(tmp_path / "small"), small, max_chunk_bytes=1 * MiB, layout=layout_name)
        m.save(1, {"big": big})
        stats = m.stats()["save"]
        assert stats["arena_waits"] > 0 and stats["bytes"] == big.nbytes
        m.wait()
        m.close()
    finally:
        small.close()
    # A restore needs room for what it returns (the arrays alias their blocks): a larger arena.
    reader = CheckpointManager(str(tmp_path / "small"), cluster.make_current())
    target = {"big": jax.ShapeDtypeStruct(big.shape, big.dtype, sharding=big.sharding)}
    assert np.asarray(reader.restore(target=target)["big"]).tobytes() == np.asarray(big).tobytes()


def test_save_without_shared_memory_uploads_the_shards(grpc_cluster, tmp_path, cluster):
    """A host the controller cannot share memory with gets its shards through the write calls."""
    state = make_state(4, rows=256)
    state["params"]["scale"] = jax.device_put(np.float32(0.25), state["params"]["b"].sharding)  # rank 0
    m = CheckpointManager(str(tmp_path / "grpc"), grpc_cluster)
    m.save(4, state)
    m.wait()
    assert m.stats()["save"]["bytes"] == sum(state["params"][k].nbytes for k in ("w", "b", "scale"))
    m.close()
    reader = CheckpointManager(str(tmp_path / "grpc"), cluster.make_current())
    assert_same(reader.restore(4, target=abstract(state)), state)
    reader.close()


def test_copies_split_over_the_copy_threads_are_exact():
    from concurrent.futures import ThreadPoolExecutor

    from colocar.checkpoint.saves.plan import copy_into

    rng = np.random.default_rng(5)
    sources = [
        rng.standard_normal((1000, 37)).astype(np.float32),  # rows not divisible by the parts
        rng.integers(0, 255, (7, 300, 3), dtype=np.uint8),
        rng.standard_normal((64, 64))[::2, 3:40],  # a strided view, as a shard's slice is
        np.array(3.5),  # 0-d
    ]
    blocks = [np.zeros(s.shape, s.dtype) for s in sources]
    with ThreadPoolExecutor(3) as copiers:
        copy_into(list(zip(blocks, sources, strict=True)), copiers, part_bytes=4096)
    for block, source in zip(blocks, sources, strict=True):
        assert block.tobytes() == np.ascontiguousarray(source).tobytes()


def test_chunk_larger_than_the_arena_is_refused(make_cluster, tmp_path, cluster):
    small = make_cluster(hosts=1, devices=jax.devices()[:1], arena_size=4 * MiB)
    x = jax.device_put(np.zeros((2048, 1024), np.float32), jax.devices()[0])  # 8 MiB, one chunk
    m = CheckpointManager(str(tmp_path / "tiny"), small, max_chunk_bytes=8 * MiB)
    with pytest.raises(CheckpointError, match="cannot fit arena pool 'default' of host 0"):
        m.save(1, {"x": x})
    m.close()
    cluster.make_current()


def test_failed_background_write_raises_on_next_save(cluster, mngr):
    state = make_state(10)
    mngr.save(1, state)
    mngr.wait()
    blocker = os.path.join(mngr.directory, layout.step_dir(2))
    os.makedirs(os.path.join(blocker, layout.HEARTBEAT, "x"))  # a directory where the heartbeat goes
    mngr.save(2, state)  # the failure happens in the sidecars, after save returned
    markers = os.path.join(blocker, layout.ATTEMPT_PREFIX + "*", layout.FAILED_DIR, "*")
    wait_for(lambda: glob.glob(markers), "the failure marker")
    mngr.stats()  # sees the failure; it is still raised by the next save
    with pytest.raises(CheckpointError, match=r"step 2 failed: host \d: .*HEARTBEAT"):
        mngr.save(3, state)
    mngr.save(3, state)  # reported once; later saves work
    mngr.wait()
    assert mngr.all_steps() == [1, 3]
    assert_same(state, mngr.restore(1, target=abstract(state)))
    # Once the cause is gone, saving the failed step again works: the retry writes its own
    # attempt (it never reads nor mixes with the failed one's objects), which goes once the
    # retry committed.
    failed_attempt = os.path.dirname(os.path.dirname(glob.glob(markers)[0]))
    shutil.rmtree(os.path.join(blocker, layout.HEARTBEAT))
    retry = make_state(11)
    mngr.save(2, retry)
    mngr.wait()
    assert mngr.all_steps() == [1, 2, 3]
    assert_same(retry, mngr.restore(2, target=abstract(retry)))
    assert not os.path.exists(failed_attempt)
    attempt = attempt_path(mngr.directory, 2)
    assert json.load(open(os.path.join(attempt, layout.MANIFEST)))["attempt"] in attempt
    for name in os.listdir(os.path.join(attempt, layout.DONE_DIR)):  # every marker names its save
        assert json.load(open(os.path.join(attempt, layout.DONE_DIR, name)))["attempt"] in attempt


def test_preemption_signal_is_recorded(cluster, tmp_path):
    m = CheckpointManager(str(tmp_path / "pre"), cluster, save_on_preemption=True, save_interval_steps=100)
    before = signal.getsignal(signal.SIGTERM)
    assert not m.reached_preemption(1) and not m.should_save(1)
    os.kill(os.getpid(), signal.SIGTERM)
    wait_for(lambda: m.reached_preemption(1), "SIGTERM to be recorded")
    assert m.should_save(1) and m.save(1, make_state(11))
    m.close()
    assert m.all_steps() == [1]
    assert signal.getsignal(signal.SIGTERM) is not before or before is signal.SIG_DFL


def test_cli_lists_and_shows(cluster, mngr):
    mngr.save(4, make_state(12), metadata={"lr": 0.1})
    mngr.wait()
    run = [sys.executable, "-c", "from colocar.cli import main; main()", "ckpt"]
    ls = subprocess.run(run + ["ls", mngr.directory, "--json"], capture_output=True, text=True, timeout=60)
    listing = json.loads(ls.stdout.strip().splitlines()[-1])
    assert [(s["step"], s["status"]) for s in listing["steps"]] == [(4, "committed")]
    show = subprocess.run(run + ["show", mngr.directory, "4"], capture_output=True, text=True, timeout=60)
    assert (
        "['params']['w']" in show.stdout and "float32[64, 32]" in show.stdout and '"lr": 0.1' in show.stdout
    )
    bad = subprocess.run(run + ["show", mngr.directory, "5"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no step 5" in bad.stderr
