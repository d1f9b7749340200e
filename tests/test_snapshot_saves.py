"""Storage saves written from host-memory snapshots (`Snapshots.save_to`), on real sidecars.

The checkpoint writers write the blocks the snapshot keepers already hold in the same sidecar:
the device arrays may even be deleted after the snapshot. A step saved so restores bit-exactly
with a plain `CheckpointManager`, its manifest is the one a save from the devices writes, a
host lost in between fails the save before anything is committed, and a later snapshot's
retention never frees blocks a save still writes (the fake GCS server is stopped meanwhile).
"""

from __future__ import annotations

import concurrent.futures
import signal
import time

import jax
import numpy as np
import pytest
from checkpoint_helpers import assert_same
from helpers import FakeGcs
from test_snapshots import POOL, _kill, _state, _target, _used, _wait_lost

import colocar
from colocar.checkpoint import CheckpointManager
from colocar.elastic import faults
from colocar.elastic.snapshots import Snapshots
from colocar.elastic.snapshots import save as snap_save
from colocar.errors import CheckpointError, SnapshotError

MiB = 1 << 20
ROWS = 8192  # 1 MiB of float32 weights: each host writes over a hundred 2 KiB chunks


def _four(make_cluster, **kwargs):
    """Four sidecars, with `make_cluster`'s quick keepalives (kills are seen at once, by the
    exit watch)."""
    return make_cluster(hosts=4, arena_size=20 * MiB, pools={POOL: 8 * MiB}, processes=0, **kwargs)


def _values(state):
    """A host copy of the state (its device arrays may be deleted afterwards)."""

    def copy(x):
        if _is_key(x):
            return np.array(jax.random.key_data(x))
        return np.array(x) if isinstance(x, jax.Array) else x

    return jax.tree_util.tree_map(copy, state)


def _is_key(x) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _delete_device_arrays(state) -> None:
    for x in jax.tree_util.tree_leaves(state):
        if isinstance(x, jax.Array):
            x.delete()


def _manifest(mngr, step: int) -> dict:
    return mngr.steps.committed_manifest(step)[1]


def _check_restore(url: str, cluster, step: int, state, expected) -> None:
    with CheckpointManager(url, cluster) as again:
        restored = again.restore(step, target=_target(state, cluster, set()))
    restored["key"] = np.asarray(jax.random.key_data(restored["key"]))
    assert_same(expected, restored)


@pytest.mark.parametrize(
    "where, rows, chunk",
    [("local", 16, 48), ("gcs", 256, 2048)],  # 48 bytes: a chunk is half a row (a strided view)
)
def test_a_snapshot_saved_to_storage_restores_bit_exactly(
    make_cluster, tmp_path, gcs_server, where, rows, chunk
):
    url, env = str(tmp_path / "ckpt"), {}
    if where == "gcs":
        gcs_server.create_bucket("colocar-snap-saves")
        url, env = "gs://colocar-snap-saves/run", gcs_server.env
    cluster = _four(make_cluster, env=env)
    state = _state(cluster, seed=3, rows=rows)
    with (
        Snapshots(cluster, replicas=1, pool=POOL) as snaps,
        CheckpointManager(url, cluster, max_chunk_bytes=chunk) as mngr,
    ):
        mngr.save(4, state)  # from the devices: the manifest to compare with
        mngr.wait()
        normal = mngr.stats()["save"]
        assert snaps.take(5, state)
        expected = _values(state)
        _delete_device_arrays(state)  # nothing is read from the devices again
        assert snaps.save_to(mngr, 5, metadata={"note": "from RAM"})
        mngr.wait()
        stats = mngr.stats()["save"]
        print(
            f"\ntrainer blocked: save from the devices {normal['blocked_seconds'] * 1e3:.1f} ms "
            f"({normal['bytes']} bytes copied), from the snapshot {stats['blocked_seconds'] * 1e3:.1f} ms"
        )
        assert stats["bytes"] == 0 and stats["pieces"] == normal["pieces"] > 8  # blocks cut in chunks
        assert mngr.all_steps() == [4, 5] and mngr.metadata(5) == {"note": "from RAM"}
        from_devices, from_snapshot = _manifest(mngr, 4), _manifest(mngr, 5)
        assert from_snapshot["leaves"] == from_devices["leaves"]
        assert from_snapshot["leaves"]["['params']['w']"]["dir"] == "params/w"  # its key path
        assert where != "local" or from_snapshot["leaves"]["['params']['w']"]["chunks"] == [1, 8]
        assert from_snapshot["tree"] == from_devices["tree"]
    _check_restore(url, cluster, 5, _state(cluster, seed=3, rows=rows), expected)


def test_a_host_lost_between_the_snapshot_and_its_save_commits_nothing(make_cluster, tmp_path):
    cluster = _four(make_cluster)
    state = _state(cluster, seed=4)
    url = str(tmp_path / "ckpt")
    with Snapshots(cluster, replicas=1, pool=POOL) as snaps:
        mngr = CheckpointManager(url, cluster)
        with pytest.raises(SnapshotError, match="no snapshot of step 7 is held"):
            snaps.save_to(mngr, 7)
        assert snaps.take(7, state)
        snaps.wait()  # replicated and committed: only the host's own blocks are missing
        _kill(cluster, 2)
        _wait_lost(cluster, 2)
        with pytest.raises(CheckpointError, match=r"snapshot step 7: host 2 .* is lost"):
            snaps.save_to(mngr, 7)
        assert mngr.all_steps() == [] and mngr.steps.committed() == []
        mngr.close()


def test_the_storage_tier_saves_from_the_devices_once_the_snapshot_was_abandoned(make_cluster, tmp_path):
    """The elastic storage tier saves the arrays the last take copied from that snapshot's
    blocks; once the snapshot was abandoned (here its replication ran out of time), the
    keepers dropped them, and the tier saves from the devices instead of failing with it."""
    cluster = _four(make_cluster)
    state = {k: v for k, v in _state(cluster, seed=7).items() if k != "table"}  # jax arrays only
    with Snapshots(cluster, replicas=1, pool=POOL, replication_timeout=0.5) as snaps:
        faults.hold_replication(cluster, 0)
        try:
            assert snaps.take(3, state)
            snaps.wait(timeout=60)
        finally:
            faults.hold_replication(cluster, 0, held=False)
        assert snaps.stats()["replication"]["state"] == "failed" and snaps.latest() is None
        with CheckpointManager(str(tmp_path / "ckpt"), cluster) as mngr:
            assert snap_save.save_if_taken(mngr, 3, state, {}) is None  # None: from the devices
            assert mngr.all_steps() == []


def test_the_storage_tier_saves_from_the_devices_when_the_snapshot_is_abandoned_in_the_hand_over(
    make_cluster, tmp_path
):
    """The tier found the snapshot of step 2 replicating and chose it; its save then waited
    for the save before (the storage server stopped meanwhile) while the replication ran out
    of time and the keepers dropped the blocks. The hand-over to the writers fails, and the
    tier saves step 2 from the devices instead: training goes on, and the step restores."""
    _with_a_storage_server_to_stop(make_cluster, tmp_path, _abandoned_in_the_hand_over)


def _abandoned_in_the_hand_over(cluster, server, url: str) -> None:
    state = {k: v for k, v in _state(cluster, seed=9).items() if k != "table"}  # jax arrays only
    snaps = Snapshots(cluster, replicas=1, pool=POOL, replication_timeout=1.0)
    mngr = CheckpointManager(url, cluster, storage_timeout=120)
    elastic = colocar.elastic.Manager(
        cluster, checkpoints=mngr, snapshots=snaps, snapshot_every=2, save_every=2
    )
    try:
        mngr.save(1, state, force=True)
        server.process.send_signal(signal.SIGSTOP)  # step 1's writes hang: step 2's save waits
        faults.hold_replication(cluster, 0)
        stepped = concurrent.futures.ThreadPoolExecutor(1).submit(elastic.step, 1, {"state": state})
        deadline = time.monotonic() + 60
        while (snaps.stats()["replication"] or {}).get("state") != "failed":  # abandoned, blocks dropped
            assert time.monotonic() < deadline and not stepped.done(), "the snapshot was not abandoned"
            time.sleep(0.05)
        server.process.send_signal(signal.SIGCONT)
        stepped.result(timeout=120)
        mngr.wait()
        assert mngr.all_steps() == [1, 2]
        assert elastic.stats()["checkpoints"]["saved_from"] == {"snapshot": 0, "devices": 1}
        assert_same(state, mngr.restore(2, target={"state": _target(state, cluster, set())})["state"])
    finally:
        server.process.send_signal(signal.SIGCONT)
        faults.hold_replication(cluster, 0, held=False)
        elastic.close()
        snaps.close()


def _with_a_storage_server_to_stop(make_cluster, tmp_path, body) -> None:
    """body(cluster, server, url) with a fake GCS server of its own (the test stops it), on four
    sidecars that reach it; the server is resumed and stopped whatever body does."""
    server = FakeGcs(str(tmp_path))
    server.start()
    try:
        with server.environment():
            server.create_bucket("colocar-snap-stop")
            cluster = _four(make_cluster, env=server.env)
            body(cluster, server, "gs://colocar-snap-stop/run")
    finally:
        server.process.send_signal(signal.SIGCONT)
        server.stop()


def test_retention_never_frees_blocks_a_save_still_writes(make_cluster, tmp_path):
    _with_a_storage_server_to_stop(make_cluster, tmp_path, _hold_while_stopped)


def _hold_while_stopped(cluster, server, url: str) -> None:
    states = {s: _state(cluster, seed=s, rows=ROWS) for s in (1, 2, 3, 4)}
    expected = _values(states[1])
    with (
        Snapshots(cluster, replicas=1, pool=POOL) as snaps,
        CheckpointManager(
            url, cluster, max_chunk_bytes=2048, concurrent_writes=1, storage_timeout=120
        ) as mngr,
    ):
        assert snaps.take(1, states[1])
        snaps.wait()
        assert snaps.save_to(mngr, 1)
        server.process.send_signal(signal.SIGSTOP)  # the writers' requests hang from here on
        for s in (2, 3, 4):  # the keepers drop step 1 (they keep 2), the pool is used again
            assert snaps.take(s, states[s])
            snaps.wait()
        assert all(1 not in snaps._keeper(h).stats() for h in range(4))
        held = _used(cluster, range(4))
        server.process.send_signal(signal.SIGCONT)
        mngr.wait()
        assert mngr.all_steps() == [1]
        assert _released(cluster, held), f"the writers held no block: {held} then {_used(cluster, range(4))}"
    _check_restore(url, cluster, 1, _state(cluster, seed=1, rows=ROWS), expected)


def _released(cluster, held: list[int]) -> bool:
    """Whether the pools came to use less than `held` (blocks go back in the background),
    before a generous deadline: none more, at least one less (a host whose writer finished
    its part before the server stopped held nothing extra)."""
    deadline = time.monotonic() + 30
    while not (less := _fewer(_used(cluster, range(4)), held)):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return less


def _fewer(used: list[int], held: list[int]) -> bool:
    pairs = list(zip(used, held, strict=True))
    return all(u <= h for u, h in pairs) and any(u < h for u, h in pairs)


def test_the_elastic_storage_tier_saves_from_a_snapshot_of_the_same_arrays(make_cluster, tmp_path):
    cluster = _four(make_cluster)
    url = str(tmp_path / "ckpt")
    snaps = Snapshots(cluster, replicas=1, pool=POOL)
    mngr = CheckpointManager(url, cluster)
    elastic = colocar.elastic.Manager(
        cluster, checkpoints=mngr, snapshots=snaps, snapshot_every=2, save_every=2
    )
    try:
        state = {k: v for k, v in _state(cluster, seed=5).items() if k != "table"}  # jax arrays only
        elastic.step(1, {"state": state})  # step 2: snapshot, then the save from its blocks
        mngr.wait()
        assert mngr.stats()["save"]["bytes"] == 0 and mngr.stats()["save"]["pieces"] > 0
        copy = {"state": jax.tree_util.tree_map(lambda x: x.copy() if isinstance(x, jax.Array) else x, state)}
        assert snap_save.save_if_taken(mngr, 2, copy, {}) is None  # equal values, other arrays: no
        with_numpy = _state(cluster, seed=6)  # a numpy leaf may change in place: from the devices
        elastic.step(3, {"state": with_numpy})
        mngr.wait()
        assert mngr.stats()["save"]["bytes"] > 0
        assert elastic.stats()["checkpoints"]["saved_from"] == {"snapshot": 1, "devices": 1}
        details = [e["detail"].split(" (")[0] for e in elastic.stats()["events"] if e["kind"] == "save"]
        assert details == ["started from the snapshot", "started from the devices"]
        restored = mngr.restore(2, target={"state": _target(state, cluster, set())})["state"]
        assert_same(state, restored)
    finally:
        elastic.close()
        snaps.close()


def test_a_snapshot_saved_in_orbax_layout_restores_bit_exactly(make_cluster, tmp_path):
    """`save_to` writes Orbax's layout from the snapshot's blocks too (no device read)."""
    url = str(tmp_path / "orbax")
    cluster = _four(make_cluster)
    state = _state(cluster, seed=5, rows=16)
    with (
        Snapshots(cluster, replicas=1, pool=POOL) as snaps,
        CheckpointManager(url, cluster, max_chunk_bytes=48, layout="orbax") as mngr,
    ):
        assert snaps.take(5, state)
        expected = _values(state)
        _delete_device_arrays(state)
        assert snaps.save_to(mngr, 5)
        mngr.wait()
        assert mngr.stats()["save"]["bytes"] == 0 and mngr.all_steps() == [5]
    assert (tmp_path / "orbax" / "5" / "default" / "_METADATA").exists()
    _check_restore(url, cluster, 5, _state(cluster, seed=5, rows=16), expected)
