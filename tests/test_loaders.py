"""Input pipelines end to end: real sidecars, worker processes, ring slots, global arrays.

The tests here share one two-host cluster (`two_hosts`); those that need a cluster of their
own, or none with shared memory, are in test_loaders_failures.py.
"""

from __future__ import annotations

import gc
import os
import signal
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import wait_for
from loaders_helpers import (
    B,
    N,
    config,
    decode_int,
    expected_labels,
    explode_on_seven,
    features,
    labels,
    row_values,
    take,
)

import colocar
from colocar import loaders


@pytest.fixture(scope="module")
def two_hosts():
    with colocar.local_cluster(hosts=2, arena_size=32 << 20, processes=0) as c:
        yield c


@pytest.fixture(autouse=True)
def _slots_back_after_each_test(two_hosts):
    """Each test leaves the shared cluster's arenas as it found them: a batch the test still
    held when it ended gives its slot back once JAX's deferred releases ran (a collection),
    so the next test's baseline is not the last one's leftovers."""
    before = [h.stats()["pools"]["default"]["used"] for h in two_hosts.hosts]
    yield
    gc.collect()
    wait_for(
        lambda: [h.stats()["pools"]["default"]["used"] for h in two_hosts.hosts] == before,
        f"the slots of the test's batches to come back (before the test: {before})",
    )


def test_batches_are_the_sampled_records_as_global_arrays(two_hosts):
    c = two_hosts.make_current()
    with loaders.load(config(), c, c.mesh(("data",))) as it:
        for k in range(3):
            batch = next(it)
            assert labels(batch) == expected_labels(k)
            assert batch["x"].shape == (B, 3) and batch["x"].sharding.spec[0] == "data"
            np.testing.assert_array_equal(np.asarray(batch["x"])[:, 0], expected_labels(k))


def test_same_batches_on_one_two_and_four_hosts(two_hosts):
    def first_batches(hosts):
        if hosts == 2:
            c = two_hosts.make_current()
            with loaders.load(config(), c) as it:
                return take(it, 3, row_values)
        with colocar.local_cluster(hosts=hosts, arena_size=16 << 20, processes=0) as c:
            with loaders.load(config(), c) as it:
                return take(it, 3, row_values)

    reference = first_batches(2)
    assert first_batches(1) == reference
    assert first_batches(4) == reference


def test_a_cluster_over_some_hosts_feeds_each_device_from_its_own_host(two_hosts):
    """A `Cluster` over a subset (the survivors of a lost host keep their indices): the second
    host alone feeds its own devices the same rows as in the whole cluster."""
    from colocar.controller_bridge.cluster import Cluster

    c = two_hosts.make_current()
    with loaders.load(config(), c) as it:
        reference = take(it, 2, row_values)
    second = Cluster([c.hosts[1]])  # its one host has index 1
    try:
        mesh = jax.sharding.Mesh(np.array(c.hosts[1].devices), ("data",))
        with loaders.load(config(), second, mesh) as it:
            assert take(it, 2, row_values) == reference  # was: IndexError (hosts[1] of a 1-host list)
    finally:
        del second
        c.make_current()


def test_exact_resume_mid_epoch_also_on_another_host_count(two_hosts):
    c = two_hosts.make_current()
    with loaders.load(config(), c) as it:
        uninterrupted = take(it, 7, labels)
    with loaders.load(config(), c) as it:
        take(it, 3, labels)
        state = it.get_state()
    import json

    state = json.loads(json.dumps(state))  # JSON-able
    with loaders.load(config(), c) as it:
        it.set_state(state)
        assert take(it, 4, labels) == uninterrupted[3:]
    with colocar.local_cluster(hosts=1, arena_size=16 << 20, processes=0) as one:
        with loaders.load(config(), one) as it:  # 2 -> 1 hosts
            it.set_state(state)
            assert take(it, 2, labels) == uninterrupted[3:5]
            state_on_one = it.get_state()
    with loaders.load(config(), two_hosts.make_current()) as it:  # 1 -> 2 hosts
        it.set_state(state_on_one)
        assert take(it, 2, labels) == uninterrupted[5:7]


def test_epochs_reshuffle_and_end(two_hosts):
    c = two_hosts.make_current()
    with loaders.load(config(num_epochs=2), c) as it:
        all_batches = [labels(b) for b in it]  # each batch dropped at once
    per_epoch = N // B
    assert len(all_batches) == 2 * per_epoch
    first, second = all_batches[:per_epoch], all_batches[per_epoch:]
    assert first != second
    assert len(set(sum(first, []))) == per_epoch * B  # no record twice within an epoch


def test_eval_mode_pads_the_last_batch_and_masks_it(two_hosts):
    c = two_hosts.make_current()
    cfg = config(eval=True, drop_remainder=False, num_epochs=1, shuffle=False)
    with loaders.load(cfg, c) as it:
        batches = [{k: np.asarray(v) for k, v in b.items()} for b in it]  # host copies: the ring cycles
    assert len(batches) == -(-N // B)
    last = batches[-1]
    assert last["mask"].sum() == N % B and last["mask"][: N % B].all()
    assert last["label"][N % B :].tolist() == [0] * (B - N % B)
    assert all(b["mask"].all() for b in batches[:-1])


def test_a_held_batch_is_never_overwritten(two_hosts):
    c = two_hosts.make_current()
    with loaders.load(config(prefetch=3), c) as it:
        held = next(it)
        before = np.asarray(held["x"]).copy()
        take(it, 6, labels)  # three turns of the ring's other two slots, while `held` keeps its own
        assert bool(jnp.array_equal(held["x"], before))  # jnp reads the buffer; np.asarray is cached


def test_a_batch_held_across_close_stays_valid_then_frees_its_slots(two_hosts):
    import gc

    c = two_hosts.make_current()
    used = lambda: [h.stats()["pools"]["default"]["used"] for h in c.hosts]  # noqa: E731
    gc.collect()  # earlier tests' dropped batches give their slots back (JAX releases at GC)
    wait_for(lambda: used() == [0, 0], "the slots of earlier tests' batches to be freed")
    baseline = used()
    it = loaders.load(config(prefetch=3, num_epochs=None), c)
    held = next(it)
    before = np.asarray(held["x"]).copy()
    take(it, 4, labels)  # the slots of dropped batches go back while `held` keeps its own
    it.close()
    assert bool(jnp.array_equal(held["x"], before))  # jnp reads the buffer; np.asarray is cached
    assert used() != baseline  # the held batch's slots are still leased
    del held
    gc.collect()
    wait_for(lambda: used() == baseline, "the held batch's slots to be freed")


def rings_wait(feeds) -> bool:
    from colocar.shm.ring import WAITING

    return all(feed._board[WAITING] == 1 for feed in feeds)


def hold_until_both_rings_wait(it):
    """Holds the first batch until both hosts' 2-slot rings wait for a slot; (batch, feeds)."""
    held = next(it)
    feeds = it._fed
    assert len(feeds) == 2  # the controller maps both arenas: batches come over feeds
    wait_for(lambda: rings_wait(feeds), "both rings to wait")
    return held, feeds


def test_a_full_ring_asks_for_signals_and_goes_on_as_slots_come_back(two_hosts):
    """While every worker has work queued, slots come back on the ring's board unannounced;
    once a worker idles for want of a slot (the consumer is slower), the board's flag asks the
    controller to signal each slot it gives back, and the pipeline goes on in order."""
    c = two_hosts.make_current()
    with loaders.load(config(prefetch=2, num_epochs=None), c) as it:
        held, feeds = hold_until_both_rings_wait(it)
        del held
        got = []
        for _ in range(6):
            got.append(labels(next(it)))
            wait_for(lambda: rings_wait(feeds), "the rings to fill again")
        assert got == [expected_labels(k, num_epochs=None) for k in range(1, 7)]


def next_in_time(it, seconds=30.0):
    """The next batch's labels, or a failure after `seconds` (a thread: a stuck feed waits forever)."""
    got = []
    thread = threading.Thread(target=lambda: got.append(labels(next(it))), daemon=True)
    thread.start()
    thread.join(seconds)
    assert got, f"no batch within {seconds} s"
    return got[0]


def test_a_lost_wake_up_is_made_up_by_the_pumps_look_at_the_board(two_hosts):
    """The board has no memory fence ("Ordering" in shm/ring.py), so the controller may read the
    ring's flag as down after the ring raised it, give its slots back without the wake-up byte,
    and the pump, which looked before they came back, waits. Here the controller really reads
    the flag down (it is lowered just before the controller gives the slots back): the pump's
    periodic look at the board (RECHECK_SECONDS) still finds them, and the pipeline goes on."""
    from colocar.shm.ring import WAITING

    c = two_hosts.make_current()
    with loaders.load(config(prefetch=2, num_epochs=None), c) as it:
        held, feeds = hold_until_both_rings_wait(it)
        for feed in feeds:
            feed._board[WAITING] = 0  # the flag as a controller without a fence may see it
        del held  # its slots go back on the next call, silently
        got = [next_in_time(it) for _ in range(4)]  # the 2-slot rings need the silent returns
        assert got == [expected_labels(k, num_epochs=None) for k in range(1, 5)]


@pytest.mark.parametrize("path", ["feed", "calls"])
def test_a_released_batch_gives_its_slots_back_at_once_and_cannot_be_read(two_hosts, grpc_cluster, path):
    """`it.release(batch)`: the batch's slots come back although the program still holds the
    batch (a 2-slot ring with both batches held goes on), reading it raises instead of showing
    later data, and a numpy view taken from it before keeps its slot and its values."""
    c = two_hosts.make_current() if path == "feed" else grpc_cluster
    with loaders.load(config(prefetch=2, num_epochs=None), c, starve_timeout=20) as it:
        assert bool(it._fed) == (path == "feed")
        first, second = next(it), next(it)  # every slot of the 2-slot rings, both still held
        it.release(first)
        with pytest.raises(RuntimeError, match="deleted"):
            np.asarray(first["x"])
        third = next_in_time(it)  # needs the released batch's slots: it would starve without
        shard = second["x"].addressable_shards[0].data
        view = np.asarray(shard)  # on the feed path, the slot's memory itself
        assert view.ctypes.data == shard.unsafe_buffer_pointer()
        values = view.copy()
        del shard
        it.release(second)
        got = [next_in_time(it) for _ in range(4)]  # the ring turns; `view` keeps its slot
        np.testing.assert_array_equal(view, values)
        assert [third, *got] == [expected_labels(k, num_epochs=None) for k in range(2, 7)]


def test_batches_dropped_while_next_waits_give_their_slots_back(two_hosts):
    """A loop that does not wait for its steps drops batches while `next()` already waits for
    a slot: JAX lets go of a dropped batch's views only in its deferred releases, which the
    wait runs, so the ring turns instead of starving (it once waited for the starve timeout:
    the releases ran only as `next()` began). The soak test found it."""
    c = two_hosts.make_current()
    with loaders.load(config(prefetch=2, num_epochs=None), c, starve_timeout=15) as it:
        held = [next(it), next(it)]  # every slot of the 2-slot ring
        dropper = threading.Timer(1.0, held.clear)  # while the next() below waits
        dropper.start()
        try:
            third = next(it)
        finally:
            dropper.join()
        assert labels(third) == expected_labels(2, num_epochs=None)


def test_a_ring_starved_by_held_batches_raises(two_hosts):
    c = two_hosts.make_current()
    with loaders.load(config(prefetch=2, num_epochs=None), c, starve_timeout=2) as it:
        held = [next(it), next(it)]  # every slot of the 2-slot ring
        with pytest.raises(Exception, match="no free slot"):
            for _ in range(10):
                held.append(next(it))


def test_bad_records_fail_with_index_and_host_or_are_skipped(two_hosts):
    c = two_hosts.make_current()
    transforms = [{"kind": "map", "fn": explode_on_seven}, {"kind": "map", "fn": features}]
    with loaders.load(config(transforms=transforms, shuffle=False), c) as it:
        with pytest.raises(Exception, match=r"record 7") as info:
            next(it)
        assert "host0" in str(info.value)
    with loaders.load(config(transforms=transforms, shuffle=False, skip_bad_records=True), c) as it:
        batch = next(it)
        mask = np.asarray(batch["mask"])
        assert mask.tolist() == [i % 10 != 7 for i in range(B)]
        assert sum(h["bad_records"] for h in it.stats()["hosts"]) >= 1


def test_killed_worker_raises_in_the_iterator(two_hosts):
    c = two_hosts.make_current()
    it = loaders.load(config(num_epochs=None), c)
    try:
        next(it)
        pid = it._remote[1].worker_pids()[0]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(Exception, match="died"):
            for _ in range(100):
                next(it)
    finally:
        it.close()


def test_close_after_an_early_break_stops_workers_and_frees_slots(two_hosts):
    import psutil

    c = two_hosts.make_current()
    baseline = [h.stats()["pools"]["default"]["used"] for h in c.hosts]
    it = loaders.load(config(num_epochs=None), c)
    for _batch in it:
        break
    del _batch
    pids = [pid for obj in it._remote for pid in obj.worker_pids()]
    it.close()
    del it
    wait_for(
        lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids),
        "the pipeline workers to exit",
    )
    wait_for(
        lambda: [h.stats()["pools"]["default"]["used"] for h in c.hosts] == baseline,
        "the ring slots to be freed",
    )


def test_array_record_source(two_hosts, tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    for f in range(2):
        writer = ArrayRecordWriter(str(tmp_path / f"part-{f}.array_record"), "group_size:1")
        for i in range(40):
            writer.write(np.array([f * 40 + i], np.int64).tobytes())
        writer.close()
    c = two_hosts.make_current()
    cfg = {
        "source": {"kind": "array_record", "paths": str(tmp_path / "*.array_record")},
        "global_batch_size": 8,
        "transforms": [{"kind": "map", "fn": decode_int}],
        "shuffle": False,
    }
    with loaders.load(cfg, c) as it:
        values = [np.asarray(b["value"]).tolist() for b in it]
    assert sum(values, []) == list(range(80))


def test_progress_line_and_stats(two_hosts, capsys):
    c = two_hosts.make_current()
    with loaders.load(config(num_epochs=1), c, progress=True) as it:
        take(it, 3, labels)
        stats = it.stats()
    assert stats["batches"] == 3 and stats["controller_wait_seconds"] >= 0
    assert [h["host"] for h in stats["hosts"]] == ["host0", "host1"]
    assert all(h["ring_slots"] == 3 and h["workers_alive"] == 1 for h in stats["hosts"])
    assert "input pipeline" in capsys.readouterr().out


def test_public_device_put_path_gives_the_same_batches(two_hosts, monkeypatch):
    """The batched put is JAX-internal; its public fallback must build the same arrays."""
    c = two_hosts.make_current()
    with loaders.load(config(), c) as it:
        fast = take(it, 2, row_values)
    monkeypatch.setattr(colocar.loaders.iterator, "batched_put_order", lambda *args: None)
    with loaders.load(config(), c) as it:
        assert it._put_order is None
        assert take(it, 2, row_values) == fast
