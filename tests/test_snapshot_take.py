"""What a snapshot's fast path must never get wrong (`Snapshots.take` and its restore).

A take copies each host's pieces into one arena block and hands it to the keeper in the
background; the layout of a state (which shard goes where) is cached per shapes, dtypes and
shardings; a restore whose slices lie within one block gets that block's bytes without a copy
(the restored array may alias them).
"""

from __future__ import annotations

import gc

import jax
import numpy as np
from checkpoint_helpers import assert_same
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import colocar
from colocar.elastic.snapshots import Snapshots
from colocar.shm.views import arena_offset


def _state(cluster, seed: int, spec: P) -> dict:
    mesh = Mesh(np.array(cluster.devices), ("data",))
    rng = np.random.default_rng(seed)
    return {
        "w": jax.device_put(rng.standard_normal((64, 32), np.float32), NamedSharding(mesh, spec)),
        "b": jax.device_put(rng.standard_normal(32).astype(np.float32), NamedSharding(mesh, P())),
        "step": seed,
    }


def _like(state: dict, spec: P | None = None) -> dict:
    """The state as a restore target: its arrays' shapes on their shardings (or on `spec`)."""

    def leaf(x):
        if not isinstance(x, jax.Array):
            return x
        sharding = x.sharding if spec is None or x.ndim != 2 else NamedSharding(x.sharding.mesh, spec)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(leaf, state)


@colocar.colocated
def _scribble(pool: str, nbytes: int) -> int:
    """Fills every free byte of `pool` it can get with 0xFF, in blocks of `nbytes`; how many."""
    import gc

    from colocar.shm.context import sidecar_runtime

    gc.collect()  # what only a cycle held is gone (and its blocks free)
    arena, blocks = sidecar_runtime(), []
    try:
        while True:
            block = arena.empty((nbytes,), np.dtype(np.uint8), pool, timeout=0.0)
            block[:] = 0xFF
            blocks.append(block)
    except Exception:  # noqa: BLE001 - the pool is full
        return len(blocks)


def test_a_restored_array_never_changes_once_its_snapshot_is_dropped(make_cluster):
    """The restore shares the snapshot's bytes (no copy); once the keepers dropped that
    snapshot, the restored array still holds the block, which no new allocation reuses."""
    cluster = make_cluster(hosts=2, arena_size=8 << 20, pools={"snap": 256 << 10}, processes=0)
    first = _state(cluster, 1, P("data"))
    with Snapshots(cluster, replicas=1, keep=2, pool="snap") as snaps:
        assert snaps.take(1, first)
        snaps.wait(60)
        restored = snaps.restore(1, _like(first))
        arena = cluster.hosts[1].connection.blocks.arena
        shard = np.asarray(restored["w"].addressable_shards[-1].data)
        assert arena_offset(arena, shard) is not None  # the restore aliases host 1's arena
        for step in (2, 3, 4):  # snapshot 1's blocks are dropped by the keepers
            assert snaps.take(step, _state(cluster, step, P("data")))
        snaps.wait(60)
        assert snaps.stats()["committed"] == [3, 4]
        assert all(n > 100 for n in _scribble.on(cluster.hosts)("snap", 512))
        assert_same(restored, first)


def test_the_same_keys_with_other_shardings_get_their_own_layout(cluster):
    sharded, replicated = _state(cluster, 5, P("data")), _state(cluster, 6, P())
    with Snapshots(cluster, replicas=1, keep=2) as snaps:
        assert snaps.take(1, sharded)
        assert snaps.take(2, replicated)  # same keys, shapes and dtypes
        snaps.wait(60)
        assert_same(snaps.restore(1, _like(sharded)), sharded)
        assert_same(snaps.restore(2, _like(replicated)), replicated)
        assert_same(snaps.restore(2, _like(replicated, P("data"))), replicated)  # onto another layout


def test_a_take_returns_only_once_the_previous_snapshot_counts(cluster):
    """A host lost right after a take then finds the snapshot before it committed: the newest
    one it can restore is at most one take old."""
    with Snapshots(cluster, replicas=1, keep=2) as snaps:
        for step in range(1, 5):
            assert snaps.take(step, _state(cluster, step, P("data")))
            assert snaps.stats()["committed"][-1:] == ([step - 1] if step > 1 else [])


def test_a_controller_that_does_not_map_the_arena_restores_the_slices_it_asked_for(grpc_cluster):
    """Without shared memory the restore downloads each slice: a slice that lies within a
    block (rows of a saved shard, restored onto a finer sharding) comes as its own bytes,
    not as the whole block (the download once streamed the whole block and failed)."""
    mesh = Mesh(np.array(grpc_cluster.devices).reshape(2, 4), ("data", "model"))
    rows = np.random.default_rng(7).standard_normal((64, 32), np.float32)
    state = {"w": jax.device_put(rows, NamedSharding(mesh, P("data"))), "step": 7}
    finer = {
        "w": jax.ShapeDtypeStruct(rows.shape, rows.dtype, sharding=NamedSharding(mesh, P(("data", "model")))),
        "step": 7,
    }
    with Snapshots(grpc_cluster, replicas=1, keep=2) as snaps:
        assert snaps.take(1, state)
        snaps.wait(60)
        assert_same(snaps.restore(1, _like(state)), state)
        restored = snaps.restore(1, finer)
        assert restored["w"].sharding == finer["w"].sharding
        assert_same(restored, state)


def test_a_snapshot_keeps_no_device_buffer_of_the_state_it_took(cluster):
    """A take copies the shards to the arenas and keeps none of them: once training drops a
    state it does not donate, its device buffers are freed. The layout cached from the first
    take and the last snapshot's follow-up once held the shards (a whole state's device
    memory, for as long as they lived)."""
    with Snapshots(cluster, replicas=1, keep=2) as snaps:
        for step in (1, 2):  # the first take caches the layout; the second reuses it
            gc.collect()
            before = len(jax.live_arrays())
            state = _state(cluster, step, P("data"))
            assert snaps.take(step, state)
            snaps.wait(60)
            del state
            gc.collect()
            assert len(jax.live_arrays()) == before
