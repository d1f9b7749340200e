"""Snapshot keepers among themselves, on real sidecars: a replica that comes before its
keeper's begin, a peer keeper made anew under its name, a peer with no room for a replica."""

from __future__ import annotations

import time

import numpy as np
import pytest
from checkpoint_helpers import assert_same
from test_snapshots import POOL, _cluster, _Keeper, _state, _target, four_hosts  # noqa: F401 - four_hosts: a fixture

import colocar
from colocar.elastic.snapshots import Snapshots
from colocar.elastic.snapshots.keepers.peers import PeerLinks, PeerOptions, Target
from colocar.shm import ArenaFullError


def test_a_replica_its_peer_has_no_room_for_fails_the_snapshot_at_once(make_cluster):
    """Host 1's pool is filled after a snapshot, so host 0's next replica is refused there: the
    snapshot is abandoned within seconds (not after the replication timeout), the previous
    one stays the newest, and the next take, with room again, counts."""
    cluster = _cluster(make_cluster)
    with Snapshots(cluster, replicas=1, pool=POOL, replication_timeout=600) as snaps:
        assert snaps.take(1, _state(cluster, 11))
        snaps.wait(60)
        filler = _fill(cluster.hosts[1])
        assert snaps.take(2, _state(cluster, 12))  # every host's own block fits (its spare)
        snaps.wait(60)
        replication = snaps.stats()["replication"]
        assert replication["step"] == 2 and replication["state"] == "failed", replication
        assert "replicating step 2 to host 1 failed: arena pool 'snap' cannot hold" in replication["error"]
        assert snaps.latest() == 1
        del filler
        third = _state(cluster, 13)
        assert snaps.take(3, third)
        snaps.wait(60)
        assert snaps.latest() == 3
        assert_same(snaps.restore(3, _target(third, cluster, {0})), third)


def _fill(host) -> list[np.ndarray]:
    """Blocks that take every free byte of the host's snapshot pool (while they live)."""
    pool = host.stats()["pools"][POOL]
    size, held = (pool["reserved"] - pool["used"]) // 4096 * 4096, []  # large blocks align to 4 KiB
    while size:
        try:
            held += host.connection.blocks.empty([((size,), np.dtype(np.uint8))], pool=POOL, timeout=0.0)
        except ArenaFullError:
            size = 0 if size == 64 else 64  # then the small blocks' leftovers, 64 bytes each
    return held


def test_a_replica_that_comes_before_its_keepers_begin_waits_for_it(four_hosts):  # noqa: F811 - the fixture
    """The controller begins every keeper and hands it its block in one call, all hosts at
    once, so a peer's replica (another session: the peer keeper's) can reach a keeper before
    that call: it waits for the begin and is kept. A replica of an attempt the keeper dropped
    is refused at once (its sender's snapshot is gone too), not after the begin wait ran out."""
    host, name = four_hosts.hosts[2], "colocar.snapshots/test-early/2"
    keeper = _Keeper.on(host, name=name, ttl=60)(2, POOL, PeerOptions(), 600.0)
    peer = colocar.connect([host.address], token_file=four_hosts.token_file, devices=[[]])
    data = np.arange(4, dtype=np.float32).tobytes()
    chunk = (0, [[0, 4]], "float32", [4], 0, data)  # leaf, bounds, dtype, shape, offset, bytes
    try:
        from_peer = peer.hosts[0].object(name)
        early = from_peer.receive.submit(5, "a", 1, *chunk)  # host 1's replica of step 5, attempt "a"
        time.sleep(0.5)
        assert not early.done(), "the replica was answered before the keeper began its step"
        keeper.begin_packed(5, "a", [], [], None, [])  # this host holds no piece of its own
        assert early.result(timeout=60) == len(data)
        assert keeper.holdings()[5]["keys"] == [(0, ((0, 4),))]
        keeper.drop(5)
        late = from_peer.receive.submit(5, "a", 1, *chunk)
        with pytest.raises(KeyError, match="holds no snapshot of step 5"):
            late.result(timeout=8)  # at once, not after the begin wait (10 s)
    finally:
        peer.close()
        keeper.close()
        keeper.delete()


def test_a_peer_keeper_made_anew_under_its_name_gets_the_next_replica(four_hosts):  # noqa: F811
    """A keeper's links keep the handle on a peer's keeper from one snapshot to the next. When
    that keeper was replaced under its name since (it expired, and a later `Snapshots` made it
    anew), the old handle is refused, and the replica goes to the new keeper: none is lost."""
    host, name = four_hosts.hosts[3], "colocar.snapshots/test-anew/3"
    links = PeerLinks(0, PeerOptions(token=open(four_hosts.token_file).read()))  # host 0's, here
    target, data = Target(3, host.address, name), np.arange(4, dtype=np.float32)
    try:
        for step in (1, 2):  # a keeper each
            keeper = _Keeper.on(host, name=name, ttl=60)(3, POOL, PeerOptions(), 600.0)
            try:
                keeper.begin_packed(step, "a", [], [], None, [])
                sent = links.send(target, step, "a", [(0, [[0, 4]], data)], lambda: None)
                assert sent == data.nbytes
                assert keeper.holdings()[step]["keys"] == [(0, ((0, 4),))]
            finally:
                keeper.close()
                keeper.delete()
    finally:
        links.close()


def test_small_pieces_sent_in_one_call_share_one_block_and_keep_their_bytes():
    """A peer sends small pieces several to a call (`receive_many`): the keeper keeps them in
    one new block (one allocation, not one each: a replica of a small state has dozens of
    pieces), each with its own bytes, dtype and shape; a larger piece's chunks in the same
    call make a block of their own, which counts once its last chunk came."""
    from colocar.elastic.snapshots.keepers.keeper import SnapshotKeeper

    keeper = SnapshotKeeper(1, POOL, PeerOptions(), 600.0)  # in this process: plain numpy blocks
    rng = np.random.default_rng(7)
    small = [rng.standard_normal(n).astype(t) for n, t in ((5, np.float32), (3, np.int64), (7, np.float16))]
    large = rng.standard_normal(64).astype(np.float32)
    half = large.nbytes // 2
    parts = [(i, [[0, a.size]], a.dtype, a.shape, 0, a.tobytes()) for i, a in enumerate(small)]
    parts.append((9, [[0, 64]], large.dtype, large.shape, 0, large.tobytes()[:half]))
    try:
        keeper.begin(4, "a", [], [])
        assert keeper.receive_many(4, "a", 2, parts) == sum(a.nbytes for a in small) + half
        held = keeper._snaps[4].replicas[2]
        views = [held[(i, ((0, a.size),))] for i, a in enumerate(small)]
        assert all(np.shares_memory(views[0].base, view) for view in views), "one block for the small pieces"
        assert (9, ((0, 64),)) not in held  # half of its bytes came
        rest = [(9, [[0, 64]], large.dtype, large.shape, half, large.tobytes()[half:])]
        assert keeper.receive_many(4, "a", 2, rest) == half
        wanted = [(i, a.dtype.name, [[0, a.size]]) for i, a in enumerate(small)] + [(9, "float32", [[0, 64]])]
        for want, got in zip([*small, large], keeper.read(4, "a", wanted), strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)
    finally:
        keeper.close()
