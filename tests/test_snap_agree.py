"""How multi-controller processes agree on snapshots (`colocar.elastic.snapshots.multi.agree`), from the
summaries each keeper gives: the newest step complete everywhere and who refills whom."""

from __future__ import annotations

import pickle

import pytest

from colocar.elastic.snapshots.multi import agree as snap_agree
from colocar.errors import SnapshotError

RING = {0: [1], 1: [0]}


def _summary(own: dict[int, str], replicas: dict[int, dict[int, str]] | None = None) -> dict:
    return {
        "own": {str(s): a for s, a in own.items()},
        "replicas": {str(q): {str(s): a for s, a in held.items()} for q, held in (replicas or {}).items()},
    }


def test_a_step_counts_when_every_process_has_its_shards_somewhere():
    both = [_summary({3: "a", 4: "b"}, {1: {3: "a", 4: "b"}}), _summary({3: "a", 4: "b"}, {0: {3: "a"}})]
    assert snap_agree.agreed(both) == [(3, "a"), (4, "b")]
    assert snap_agree.refills(both, 4, "b", RING) == ([], [(0, 0, 1)])  # host 1 lacks 0's replica of 4


def test_a_replaced_host_is_refilled_from_its_peer_then_holds_its_replica_again():
    replaced = [_summary({4: "b"}, {1: {4: "b"}}), _summary({})]
    assert snap_agree.agreed(replaced) == [(4, "b")]
    first, second = snap_agree.refills(replaced, 4, "b", RING)
    assert first == [(0, 1, 1)]  # host 0 sends host 1's shards back to host 1
    assert second == [(0, 0, 1)]  # and its own shards as host 1's replica


def test_steps_of_other_takes_or_with_shards_nowhere_do_not_count():
    other_take = [_summary({4: "b"}), _summary({4: "c"}, {0: {4: "b"}})]
    assert snap_agree.agreed(other_take) == []  # host 1 holds no shards of its own of take "b"
    assert snap_agree.agreed([_summary({4: "b"}), _summary({4: "c"})]) == []
    lost = [_summary({4: "b"}), _summary({})]  # host 1's shards had no replica
    assert snap_agree.agreed(lost) == []
    with pytest.raises(SnapshotError, match="no process holds the shards of process 1"):
        snap_agree.refills(lost, 4, "b", RING)


def test_a_record_counts_only_with_all_its_shards():
    record = pickle.dumps({"shards": [(0, [[0, 4], [0, 2]]), (1, [])]})
    keys = [(0, ((0, 4), (0, 2))), (1, ())]
    assert snap_agree.complete(record, keys) is not None
    assert snap_agree.complete(record, keys[:1]) is None
    assert snap_agree.complete(None, keys) is None


def test_a_keeper_that_cannot_be_read_leaves_no_step_in_any_process():
    """Its process still takes part with a summary saying why: every process finds no step."""
    unread = snap_agree.unreadable(1, OSError("reads fail"))
    both = [_summary({4: "b"}, {1: {4: "b"}}), unread]
    assert snap_agree.agreed(both) == []
    assert snap_agree.errors(both) == ["process 1: OSError: reads fail"]


def test_a_job_restarted_with_fewer_processes_needs_every_taker_held_somewhere():
    """Three processes took step 4 (their records say so); two restart: host 2's shards count
    only as a survivor's replica, and are read from it (`absent`), never refilled."""
    took = {"4": 3}
    held = [
        {**_summary({4: "b"}, {2: {4: "b"}}), "processes": took},
        {**_summary({4: "b"}), "processes": took},
    ]
    assert snap_agree.agreed(held) == [(4, "b")]
    assert snap_agree.absent(held, 4) == [2]
    assert snap_agree.holders(held, 4, "b", 2) == [0]
    assert snap_agree.refills(held, 4, "b", RING) == ([], [(0, 0, 1), (1, 1, 0)])
    gone = [{**_summary({4: "b"}), "processes": took}, {**_summary({4: "b"}), "processes": took}]
    assert snap_agree.agreed(gone) == []  # host 2's shards are nowhere: not the two survivors' alone
    assert snap_agree.absent([_summary({4: "b"}), _summary({4: "b"})], 4) == []  # records without a count
