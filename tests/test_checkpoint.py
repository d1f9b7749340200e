"""Checkpoints: real sidecars writing zarr3 through tensorstore to a local disk and a real GCS
server (fake-gcs-server), restores with resharding, retention, corruption, and failures."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import FakeGcs, wait_for
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from colocar.checkpoint import CheckpointError, CheckpointManager, layout

MiB = 1 << 20


def make_state(seed: int = 0, rows: int = 64) -> dict:
    """Arrays sharded over the session cluster's 8 devices (2 hosts x 4), and plain values."""
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    rng = np.random.default_rng(seed)
    return {
        "params": {
            "w": jax.device_put(
                rng.standard_normal((rows, 32), np.float32), NamedSharding(mesh, P("data", "model"))
            ),
            "b": jax.device_put(rng.standard_normal(32).astype(ml_dtypes.bfloat16), NamedSharding(mesh, P())),
        },
        "step": seed,
        "data": {"epoch": 1, "positions": [3, 5], "source": "train"},
    }


def assert_same(a, b) -> None:
    """Bit-exact equality of two trees (arrays compared as bytes, keys by key data)."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, jax.Array | np.ndarray):
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                assert y.dtype == x.dtype
                x, y = jax.random.key_data(x), jax.random.key_data(y)
            x, y = np.asarray(x), np.asarray(y)
            assert x.dtype == y.dtype and x.shape == y.shape
            assert x.tobytes() == y.tobytes()
        else:
            assert x == y


def abstract(tree):
    return jax.tree_util.tree_map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x
        ),
        tree,
    )


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


def test_resharded_restore_to_fewer_devices_and_another_mesh(cluster, mngr, make_cluster):
    rows = 4096  # 512 KiB; small outer and inner chunks make the read accounting visible
    state = make_state(3, rows=rows)
    m = CheckpointManager(mngr.directory, cluster, max_chunk_bytes=64 * 1024, stale_seconds=0.5)
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
            entry = json.loads(open(os.path.join(mngr.directory, layout.step_dir(5), "manifest.json")).read())
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
    leaf = json.load(open(os.path.join(mngr.directory, layout.step_dir(1), "manifest.json")))["leaves"]
    array = os.path.join(
        mngr.directory, layout.step_dir(1), layout.array_dir(leaf["['params']['w']"]["index"])
    )
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
    assert m.all_steps() == [1] and not lease.exists()  # released at close


def test_arena_smaller_than_the_checkpoint_applies_backpressure(make_cluster, tmp_path, cluster):
    small = make_cluster(hosts=2, arena_size=8 * MiB, processes=1)
    mesh = small.mesh(("data",), (8,))
    big = jax.device_put(
        np.random.default_rng(9).standard_normal((8 * 256, 4096), np.float32),
        NamedSharding(mesh, P("data")),
    )  # 32 MiB: 16 MiB per host's 8 MiB arena
    try:
        m = CheckpointManager(str(tmp_path / "small"), small, max_chunk_bytes=1 * MiB)
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
    m = CheckpointManager(str(tmp_path / "grpc"), grpc_cluster)
    m.save(4, state)
    m.wait()
    assert m.stats()["save"]["bytes"] == state["params"]["w"].nbytes + state["params"]["b"].nbytes
    m.close()
    reader = CheckpointManager(str(tmp_path / "grpc"), cluster.make_current())
    assert_same(reader.restore(4, target=abstract(state)), state)
    reader.close()


def test_copies_split_over_the_copy_threads_are_exact():
    from concurrent.futures import ThreadPoolExecutor

    from colocar.checkpoint.save import copy_into

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
    os.makedirs(blocker)
    open(os.path.join(blocker, "arrays"), "w").close()  # a file where the arrays' directory goes
    mngr.save(2, state)  # the failure happens in the sidecars, after save returned
    failed = os.path.join(blocker, layout.FAILED_DIR)
    wait_for(lambda: os.path.isdir(failed) and os.listdir(failed), "the failure marker")
    mngr.stats()  # sees the failure; it is still raised by the next save
    with pytest.raises(CheckpointError, match=r"step 2 failed: host \d: .*\['params'\]\[.*Not a directory"):
        mngr.save(3, state)
    mngr.save(3, state)  # reported once; later saves work
    mngr.wait()
    assert mngr.all_steps() == [1, 3]
    assert_same(state, mngr.restore(1, target=abstract(state)))
    # Once the cause is gone, saving the failed step again works: what the failed save left
    # (its failure markers, heartbeat) is removed first, so the retry neither fails on it nor
    # mixes with it.
    assert os.listdir(failed)
    os.remove(os.path.join(blocker, "arrays"))
    # A storage error while removing them fails the retry before anything is written.
    manifest = os.path.join(blocker, layout.MANIFEST)
    os.makedirs(os.path.join(manifest, "x"))  # cannot be deleted as a file
    with pytest.raises(CheckpointError, match="removing what a failed save of step 2 left failed: cannot"):
        mngr.save(2, make_state(11))
    assert mngr.all_steps() == [1, 3] and os.listdir(failed)
    shutil.rmtree(manifest)
    retry = make_state(11)
    mngr.save(2, retry)
    mngr.wait()
    assert mngr.all_steps() == [1, 2, 3]
    assert_same(retry, mngr.restore(2, target=abstract(retry)))
    markers = os.listdir(os.path.join(blocker, layout.DONE_DIR))
    attempt = json.load(open(os.path.join(blocker, layout.MANIFEST)))["attempt"]
    for name in markers:  # every marker names the save it belongs to
        assert json.load(open(os.path.join(blocker, layout.DONE_DIR, name)))["attempt"] == attempt


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


TRAINER = """
import os, sys, signal
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import colocar
from colocar.checkpoint import CheckpointManager
addresses, token_file, directory = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
cluster = colocar.connect(addresses, token_file=token_file)
mesh = Mesh(np.array(jax.devices()).reshape(8), ("d",))
values = np.arange(8 * 1024 * 64, dtype=np.float32).reshape(8 * 1024, 64)
w = jax.device_put(values, NamedSharding(mesh, P("d")))
m = CheckpointManager(directory, cluster, max_chunk_bytes=64 * 1024)
m.save(1, {"w": w, "note": "from a dead trainer"})
os.kill(os.getpid(), signal.SIGKILL)  # right after save returned: nothing else runs here
"""


def test_trainer_killed_after_save_still_commits(make_cluster, tmp_path, cluster):
    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True, lease_seconds=2)
    directory = str(tmp_path / "orphan")
    try:
        trainer = subprocess.run(
            [
                sys.executable,
                "-c",
                TRAINER,
                ",".join(h.address for h in sidecars.hosts),
                sidecars.token_file,
                directory,
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert trainer.returncode == -signal.SIGKILL, trainer.stderr[-3000:]
        wait_for(
            lambda: os.path.exists(os.path.join(directory, layout.step_dir(1), layout.COMMITTED)),
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


PAUSED_WRITER = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, numpy as np
import colocar
from colocar.checkpoint import CheckpointError, CheckpointManager
address, token_file, directory = sys.argv[1:4]
cluster = colocar.connect([address], token_file=token_file)
m = CheckpointManager(directory, cluster, lease_seconds=2)
m.save(1, {"x": np.arange(4)})
m.wait()
print("ready", flush=True)
sys.stdin.readline()  # the test paused this process, let another writer take over, resumed it
try:
    m.save(2, {"x": np.arange(4)})
    m.wait()
    print("saved", flush=True)
except CheckpointError as e:
    print("refused:", e, flush=True)
"""


def test_lease_taken_over_from_a_paused_writer_stops_it(make_cluster, tmp_path, cluster):
    """A writer paused past its lease (SIGSTOP: a frozen VM, a long GC) loses the directory to the
    next writer and, once resumed, refuses to save instead of writing over the new one's steps."""
    sidecars = make_cluster(hosts=1, persist=True)
    directory = str(tmp_path / "paused")
    holder = subprocess.Popen(
        [sys.executable, "-c", PAUSED_WRITER, sidecars.hosts[0].address, sidecars.token_file, directory],
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


# One of two jax.distributed CPU processes (argv: process index, coordinator port, its own
# sidecar's address, the token file, the checkpoint directory), connected to its own sidecar.
TWO_PROCESSES = """
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, numpy as np
process, port = int(sys.argv[1]), sys.argv[2]
address, token_file, directory = sys.argv[3:6]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process)
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import colocar
from colocar.checkpoint import CheckpointManager
cluster = colocar.connect([address], token_file=token_file)
"""

MULTI_CONTROLLER = (
    TWO_PROCESSES
    + """
full = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
def make(sharding):
    return jax.make_array_from_callback(full.shape, sharding, lambda index: full[index])
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("d", "m"))
state = {"w": make(NamedSharding(mesh, P("d", "m"))), "b": make(NamedSharding(mesh, P())), "step": 3,
         "host": np.arange(4)}
m = CheckpointManager(directory, cluster, max_chunk_bytes=1 << 20)
m.save(3, state)
m.wait()
other = NamedSharding(Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b")), P("b", "a"))
restored = m.restore(target={"w": jax.ShapeDtypeStruct(full.shape, np.float32, sharding=other), "step": None,
                             "host": None})
for shard in restored["w"].addressable_shards:
    assert np.array_equal(np.asarray(shard.data), full[shard.index])
assert restored["step"] == 3 and np.array_equal(restored["host"], np.arange(4))
read = m.stats()["restore"]["bytes_read"]
m.close()
print("OK", json.dumps(read), flush=True)
"""
)


def test_multi_controller_save_and_restore(make_cluster, tmp_path, cluster):
    """Two JAX processes (jax.distributed on CPU), each with its own sidecar: each writes the
    shards it holds, process 0's sidecar commits, each restores only its devices' slices."""
    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True)
    directory = str(tmp_path / "multi")
    trainers = _two_processes(MULTI_CONTROLLER, sidecars, directory)
    try:
        outputs = [t.communicate(timeout=240)[0] for t in trainers]
        for t, out in zip(trainers, outputs, strict=True):
            assert t.returncode == 0 and "OK" in out, out[-3000:]
        step = os.path.join(directory, layout.step_dir(3))
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
        _stop(trainers)
        cluster.make_current()


# Both processes hold `w` sharded over their 8 devices and a manager with a 5 s commit_timeout.
TWO_SAVERS = (
    TWO_PROCESSES
    + """
full = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
mesh = Mesh(np.array(jax.devices()).reshape(8), ("d",))
w = jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("d")), lambda index: full[index])
m = CheckpointManager(directory, cluster, max_chunk_bytes=1 << 20, commit_timeout=5)
"""
)

MULTI_CONTROLLER_SAVES = (
    TWO_SAVERS
    + """
print("ready", flush=True)
sys.stdin.readline()  # meanwhile the test breaks something (kills a sidecar, takes the lease)
for step in (3, 4):  # the second save, after a failed one, must agree on what it is too
    try:
        m.save(step, {"w": w})
        m.wait()
        print("committed", step, flush=True)
    except Exception as e:
        print("failed:", step, type(e).__name__, e, flush=True)
"""
)


def test_multi_controller_save_with_process_0s_sidecar_lost_fails_everywhere(make_cluster, tmp_path, cluster):
    """Process 0's sidecar (the one that commits) is gone: process 0's save fails at once, and
    process 1's `wait` fails too (a failure marker, or at the latest `commit_timeout` after its
    own part is durable) instead of waiting forever for a commit that cannot come."""
    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True)
    directory = str(tmp_path / "multi-lost")
    trainers = _two_processes(MULTI_CONTROLLER_SAVES, sidecars, directory)
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
        _stop(trainers)
        cluster.make_current()


def test_multi_controller_save_refused_to_process_0_fails_every_process(make_cluster, tmp_path, cluster):
    """Another job holds the directory's lease: process 0 is refused before its save starts, and
    process 1, waiting for process 0's attempt id, hears of it at once instead of timing out."""
    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True)
    directory = str(tmp_path / "multi-refused")
    other_job = CheckpointManager(directory, cluster)
    other_job.save(1, make_state(1))
    other_job.wait()
    script = MULTI_CONTROLLER_SAVES.replace("for step in (3, 4):", "for step in (3,):")
    trainers = _two_processes(script, sidecars, directory)
    try:
        outputs = _run_after_ready(trainers)
        assert "failed: 3 CheckpointError" in outputs[0] and "another CheckpointManager" in outputs[0], (
            outputs[0]
        )
        assert "process 0 could not start the save of step 3" in outputs[1], outputs[1][-3000:]
        assert "another CheckpointManager" in outputs[1]
    finally:
        _stop(trainers)
        other_job.close()
        cluster.make_current()


def test_multi_controller_process_0_never_saving_times_out_in_the_others(make_cluster, tmp_path, cluster):
    """Process 0 skips a save the others make (a bug in the training loop): they wait for its
    attempt id at most `commit_timeout`, then raise saying so, instead of hanging."""
    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True)
    directory = str(tmp_path / "multi-skipped")
    only_1 = "for step in (3,) if process == 1 else ():"
    script = MULTI_CONTROLLER_SAVES.replace("for step in (3, 4):", only_1)
    trainers = _two_processes(script, sidecars, directory)
    try:
        outputs = _run_after_ready(trainers)
        assert "failed: 3 CheckpointError" in outputs[1], outputs[1][-3000:]
        assert "process 0 did not start its save of step 3 within commit_timeout (5 s)" in outputs[1]
        assert not os.path.exists(os.path.join(directory, layout.step_dir(3)))  # nothing was written
    finally:
        _stop(trainers)
        cluster.make_current()


MULTI_CONTROLLER_WEDGED = (
    TWO_SAVERS
    + """
if process == 0:
    m.save(3, {"w": w})
    print("saved", flush=True)
sys.stdin.readline()  # process 1 saves once the test has stopped process 0's sidecar
if process == 1:
    try:
        m.save(3, {"w": w})
        m.wait()
        print("committed", flush=True)
    except Exception as e:
        print("failed:", type(e).__name__, e, flush=True)
"""
)


def test_multi_controller_commit_never_coming_times_out_in_the_others(make_cluster, tmp_path, cluster):
    """Process 0's sidecar, which commits, hangs (SIGSTOP) after process 0's save returned:
    process 1's `wait` raises `commit_timeout` after its own part is durable instead of
    waiting forever for a commit marker that nobody writes."""
    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True)
    directory = str(tmp_path / "multi-wedged")
    trainers = _two_processes(MULTI_CONTROLLER_WEDGED, sidecars, directory)
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
        step = os.path.join(directory, layout.step_dir(3))
        assert os.listdir(os.path.join(step, layout.DONE_DIR)) == ["host_1.json"]  # its part is durable
        assert not os.path.exists(os.path.join(step, layout.COMMITTED))
        wedged.kill()  # a host that hung stays out: the step is never committed
        assert trainers[0].wait(timeout=120) == 0
    finally:
        wedged.send_signal(signal.SIGCONT)
        _stop(trainers)
        cluster.make_current()


def _two_processes(script: str, sidecars, directory: str) -> list[subprocess.Popen]:
    """Starts `script` (TWO_PROCESSES + a body) as processes 0 and 1, each on its own sidecar."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                script,
                str(i),
                port,
                sidecars.hosts[i].address,
                sidecars.token_file,
                directory,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]


def _run_after_ready(trainers: list[subprocess.Popen], meanwhile=None) -> list[str]:
    """Waits until every process printed "ready", runs `meanwhile`, lets them all go at once
    (each one's exit waits for the other: jax.distributed) and returns their output."""
    for t in trainers:
        assert t.stdout.readline().strip() == "ready", t.stdout.read()[-3000:]
    if meanwhile is not None:
        meanwhile()
    for t in trainers:
        t.stdin.write("go\n")
        t.stdin.flush()
    return [t.communicate(timeout=120)[0] for t in trainers]


def _stop(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        if p.poll() is None:
            p.kill()
            p.wait()


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
