"""A host lost while the newest snapshot replicates (`colocar.elastic.Snapshots`, real sidecars).

Replication is held back on chosen hosts (`faults.hold_replication`) so the loss lands while
it is in flight: the snapshot counts when every shard is complete on a live host, else the
previous complete one stays.
"""

from __future__ import annotations

from checkpoint_helpers import assert_same
from helpers import wait_for
from test_snapshots import POOL, _cluster, _kill, _state, _target

from colocar.elastic import faults
from colocar.elastic.snapshots import Snapshots


def test_a_host_lost_during_replication_keeps_the_previous_snapshot(make_cluster):
    cluster = _cluster(make_cluster)
    with Snapshots(cluster, replicas=1, pool=POOL) as snaps:
        first = _state(cluster, 4, rows=8)
        assert snaps.take(1, first)
        snaps.wait(60)
        for h in range(4):  # step 2's replicas stay in flight until host 3 is gone
            faults.hold_replication(cluster, h)
        try:
            assert snaps.take(2, _state(cluster, 5))
            assert snaps.stats()["replication"]["state"] == "replicating"  # take did not wait for it
            _kill(cluster, 3)
        finally:
            for h in range(3):
                faults.hold_replication(cluster, h, held=False)
        snaps.wait(60)
        replication = snaps.stats()["replication"]
        assert (replication["step"], replication["state"]) == (2, "failed")
        assert snaps.latest() == 1
        assert_same(snaps.restore(1, _target(first, cluster, {3})), first)


def test_a_host_lost_after_its_shards_reached_a_peer_keeps_the_snapshot_in_flight(make_cluster):
    """Host 3 is lost while step 2 still replicates, but once its own shards reached their
    replica: every shard of step 2 is on a live host, so it counts (before, step 1 did: a loss
    right after a take cost two snapshot intervals instead of one)."""
    cluster = _cluster(make_cluster)
    with Snapshots(cluster, replicas=1, pool=POOL) as snaps:
        assert snaps.take(1, _state(cluster, 4, rows=8))
        snaps.wait(60)
        for h in range(3):  # hosts 0-2 hold their replicas back; host 3 sends its own
            faults.hold_replication(cluster, h)
        try:
            second = _state(cluster, 5)
            assert snaps.take(2, second)
            attempt = snaps._records[2]["attempt"]
            wait_for(
                lambda: snaps._keepers[3].status(2, attempt, 1.0)["state"] == "replicated",
                "host 3's shards to reach its peer",
            )
            assert snaps.stats()["replication"]["state"] == "replicating"
            _kill(cluster, 3)
        finally:
            for h in range(3):
                faults.hold_replication(cluster, h, held=False)
        assert snaps.latest() == 2  # it waits for the snapshot in flight to end
        replication = snaps.stats()["replication"]
        assert (replication["step"], replication["state"]) == (2, "committed"), replication
        assert "without hosts [3]" in replication["error"]
        assert_same(snaps.restore(2, _target(second, cluster, {3})), second)
