"""Elastic training in one controller: a host killed or stopped at a seeded step, recovery on
the survivors from the newest committed checkpoint, exact to the bit and to the record.

Three local sidecars with two CPU devices each; a tiny linear model; a range pipeline whose
records carry their ids. The uninterrupted run is the reference: the state restored after the
loss is its state at that step, bit for bit; the steps after it match a run started from that
state on the smaller mesh; the records the final state saw are its record stream, in order.
"""

from __future__ import annotations

import contextlib
import os
import time

import jax
import psutil
import pytest
from elastic_helpers import (
    B,
    Log,
    abstract,
    assert_bitwise,
    config,
    init,
    make_train,
    mesh_of,
    plain_run,
    replicated,
)
from helpers import kill_if_stopped

import colocar
from colocar.checkpoint import CheckpointManager
from colocar.elastic import ElasticError, Manager, faults
from colocar.elastic.policy.data import start_batch
from colocar.loaders.config import load_config
from colocar.loaders.sampler import IndexSampler

STEPS = 8
MiB = 1 << 20


@contextlib.contextmanager
def three_hosts(shm_dir: str, hosts: int = 3):
    """Three (or `hosts`) sidecars with two devices each; afterwards, every process they started (pipeline
    workers of a killed sidecar included) is gone and their arena files too."""
    before = set(os.listdir(shm_dir))
    c = colocar.local_cluster(
        hosts=hosts,
        devices=jax.devices()[: 2 * hosts],
        arena_size=16 * MiB,
        lease_seconds=2,
        heartbeat_seconds=0.5,
        processes=0,
    )
    started = []
    try:
        for process in c.processes:
            started += [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
        yield c, started
    finally:
        for process in c.processes:
            kill_if_stopped(process)
        c.close()
    gone, alive = psutil.wait_procs(started, timeout=30)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
    assert set(os.listdir(shm_dir)) <= before


# seed 0 recovers from snapshots; the odd seeds from storage only (the quick suite's storage
# recovery: test_a_shard_and_its_only_replica_lost_falls_back_to_storage_and_says_so)
@pytest.mark.parametrize("seed", [0, *[pytest.param(s, marks=pytest.mark.slow) for s in range(1, 10)]])
def test_killed_host_resumes_exactly_on_the_survivors(seed, shm_dir, tmp_path):
    fault = faults.random_kill(3, range(STEPS - 2), seed, spare=())
    with three_hosts(shm_dir) as (c, started):
        reference, ref_ids, _ = plain_run(c.devices, init(mesh_of(c.devices)), 0, STEPS)
        mngr = CheckpointManager(str(tmp_path / "ckpt"), c)
        # seed 0 uses snapshots when colocar.elastic.snapshots is there; seed 1 storage only
        el = Manager(
            c,
            mngr,
            save_every=2,
            snapshot_every=3,
            snapshots=None if seed % 2 == 0 else False,
            faults=[fault],
        )
        log = Log()
        final = el.run(min_hosts=2)(make_train(el, log, STEPS))()
        started += log.processes  # the pipeline workers, those of the killed host's too
        # the first attempt's loaders were closed at the loss: their workers end on every host
        assert log.workers and not psutil.wait_procs(log.workers, timeout=30)[1]
        try:
            stats = el.stats()
            assert stats["counts"]["fault"] == stats["counts"]["loss"] == stats["counts"]["recovery"] == 1
            assert stats["lost"] == [fault.host_name] and el.attempt == 2
            assert fault.host_name not in stats["hosts"] and len(el.cluster.devices) == 4
            attempt, restored, state = log.restored[-1]
            loss = next(e for e in stats["events"] if e["kind"] == "loss")
            assert restored <= loss["step"] + 1  # training may go on until the loss surfaces
            assert el.restored_from in (("init",) if restored == 0 else ("storage", "snapshot"))
            assert_bitwise(state, reference[restored])
            assert log.trained_on() == ref_ids
            # the steps after the loss equal a run from the restored state on the smaller mesh
            small = mesh_of(el.cluster.devices)
            start = jax.device_put(reference[restored], replicated(small))
            after, _, losses = plain_run(el.cluster.devices, start, restored, STEPS)
            assert [loss for a, _, _, loss in log.steps if a == attempt] == losses
            assert_bitwise(final, after[STEPS])
        finally:
            el.close()
            del final


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_two_hosts_killed_one_after_the_other(seed, shm_dir, tmp_path):
    """Four hosts, then three, then two; the global batch of 24 divides 8, 6 and 4 devices."""
    first = faults.random_kill(4, range(STEPS // 2), seed, spare=())
    second = faults.random_kill(4, range(STEPS // 2, STEPS - 1), seed + 100, spare=(first.host,))
    cfg = config(global_batch_size=24)
    with three_hosts(shm_dir, hosts=4) as (c, started):
        reference, ref_ids, _ = plain_run(c.devices, init(mesh_of(c.devices)), 0, STEPS, 24)
        mngr = CheckpointManager(str(tmp_path / "ckpt"), c)
        el = Manager(c, mngr, save_every=2, snapshots=False, faults=[first, second])
        log = Log()
        final = el.run(min_hosts=2)(make_train(el, log, STEPS, cfg=lambda devices: cfg))()
        started += log.processes
        try:
            assert el.attempt == 3 and len(el.cluster.devices) == 4
            assert sorted(el.stats()["lost"]) == sorted([first.host_name, second.host_name])
            for attempt, restored, state in log.restored[1:]:  # each bit-identical to what was saved
                assert_bitwise(state, log.saved_state(attempt, restored, reference))
            assert log.trained_on() == ref_ids
            attempt, restored, state = log.restored[-1]
            start = jax.device_put(state, replicated(mesh_of(el.cluster.devices)))
            after, _, losses = plain_run(el.cluster.devices, start, restored, STEPS, 24)
            assert [loss for a, _, _, loss in log.steps if a == attempt] == losses
            assert_bitwise(final, after[STEPS])
        finally:
            el.close()


@pytest.mark.parametrize(
    ("every", "kill_at", "steps"), [pytest.param(1, 4, STEPS, marks=pytest.mark.slow), (9, 17, 20)]
)
def test_recovery_comes_from_the_newest_snapshot_in_ram(shm_dir, tmp_path, every, kill_at, steps):
    """Snapshots often, storage saves rarely: after host1 is killed the state comes back from
    the survivors' arenas (its shards from their replicas), bit-exactly, and the record stream
    is the uninterrupted run's. Killed right after a snapshot every 9 steps, that one may be
    incomplete: the one before it (9 steps older) is used, not storage."""
    with three_hosts(shm_dir) as (c, started):
        reference, ref_ids, _ = plain_run(c.devices, init(mesh_of(c.devices)), 0, steps)
        mngr = CheckpointManager(str(tmp_path / "ckpt"), c)
        kill = faults.kill("host1", at_step=kill_at)
        el = Manager(c, mngr, save_every=100, snapshot_every=every, faults=[kill])
        log = Log()
        try:
            el.run(min_hosts=2)(make_train(el, log, steps))()
            started += log.processes
            attempt, restored, state = log.restored[-1]
            assert el.restored_from == "snapshot" and restored >= kill_at + 1 - every, (
                el.restored_from,
                restored,
            )
            assert_bitwise(state, reference[restored])
            assert log.trained_on() == ref_ids
        finally:
            el.close()


def test_a_shard_and_its_only_replica_lost_falls_back_to_storage_and_says_so(shm_dir, tmp_path):
    """replicas=1 and two hosts of four lost at once, one holding the other's only replica (the
    state is replicated: host0 snapshots it, host1 holds the replica): no snapshot is
    recoverable, the run resumes from the storage step, bit-exactly, and a "fallback" event (a
    warning) names the snapshot and why it is unusable."""
    cfg = config(global_batch_size=24)
    with three_hosts(shm_dir, hosts=4) as (c, started):
        reference, ref_ids, _ = plain_run(c.devices, init(mesh_of(c.devices)), 0, STEPS, 24)
        mngr = CheckpointManager(str(tmp_path / "ckpt"), c)
        el = Manager(c, mngr, save_every=4, snapshot_every=2, replicas=1)
        step = el.step

        def step_then_kill(s, tree):  # after step 5: step 4's save committed, then both killed
            step(s, tree)
            if s == 5 and el.attempt == 1:
                el.checkpoints.wait(timeout=120)
                for host in (0, 1):
                    faults.inject(c, faults.kill(host))

        el.step = step_then_kill
        log = Log()
        try:
            final = el.run(min_hosts=2)(make_train(el, log, STEPS, cfg=lambda devices: cfg))()
            started += log.processes
            attempt, restored, state = log.restored[-1]
            assert el.restored_from == "storage" and restored == 4, (el.restored_from, restored)
            assert_bitwise(state, reference[restored])
            assert log.trained_on() == ref_ids
            fell = [e for e in el.stats()["events"] if e["kind"] == "fallback"]
            assert fell and "storage step 4" in fell[-1]["detail"], el.stats()["events"]
            assert "not recoverable" in fell[-1]["detail"] or "not committed" in fell[-1]["detail"]
            del final
        finally:
            el.close()


def test_stopped_host_and_the_per_device_batch_rule_lose_and_repeat_no_record(shm_dir, tmp_path):
    """A hung sidecar (SIGSTOP) is a loss too. After it the global batch follows the devices
    (2 per device: 12, then 8); the position is in records, so the records trained on are the
    epoch's, each once, in order."""
    with three_hosts(shm_dir) as (c, started):
        mngr = CheckpointManager(str(tmp_path / "ckpt"), c)
        el = Manager(c, mngr, save_every=2, snapshots=False, faults=[faults.stop("host2", at_step=3)])
        log = Log()
        source = {"kind": "range", "n": 96}
        train = make_train(
            el, log, None, lambda devices: config(source=source, global_batch_size=2 * len(devices))
        )
        try:
            el.run(min_hosts=2)(train)()
            started += log.processes
            # prefetched batches of host2 and saves it takes no part in (the state is replicated)
            # may carry training past the stop until its loss surfaces; then batch 6 is missing
            assert el.stats()["lost"] == ["host2"] and el.restored_step in (2, 4, 6)
            sizes = {len(ids) for a, _, ids, _ in log.steps if a == 2}
            assert sizes == {8}
            stream = [i for ids in log.trained_on() for i in ids]
            assert stream == IndexSampler(96, B, seed=3).epoch_order(0).tolist()
        finally:
            el.close()


def test_a_checkpoint_without_the_data_position_is_not_resumed_from_record_zero(cluster, tmp_path):
    """A step saved without its iterator cannot say where the data stood: opening the loader
    there raises instead of starting the records over."""
    with Manager(cluster, CheckpointManager(str(tmp_path / "ckpt"), cluster), save_every=1) as el:

        @el.run()
        def once(hosts, devices):
            mesh = mesh_of(devices)
            state, step = el.restore(abstract(mesh), init=lambda: init(mesh))
            assert el.data_start(config()) == 0 and el.data_state is None
            el.step(step, {"state": state})  # no iterator: no data position
            el.checkpoints.wait()
            state, step = el.restore(abstract(mesh))
            assert (step, el.restored_from) == (1, "storage")
            with pytest.raises(ElasticError, match="holds no position for data 'data'"):
                el.data_start(config())

        once()


def test_user_errors_propagate_and_too_few_hosts_is_an_error(shm_dir):
    with three_hosts(shm_dir) as (c, _):
        el = Manager(c)

        @el.run(min_hosts=2)
        def fails(hosts, devices):
            faults.inject(c, faults.kill(2))
            deadline = time.monotonic() + 30
            while c.hosts[2].connection.session.lost is None and time.monotonic() < deadline:
                time.sleep(0.05)
            raise ValueError("the user's own error")

        with pytest.raises(ValueError, match="user's own"):
            fails()  # a host is lost meanwhile, yet the user's error is not taken for the loss
        assert el.attempt == 1 and el.stats()["counts"]["loss"] == 0

        @el.run(min_hosts=2)
        def loses(hosts, devices):
            assert [h.name for h in hosts] == ["host0", "host1"]
            faults.inject(c, faults.kill("host1"))
            while True:
                el.step(0, {})  # raises HostLostError once host1 is marked lost
                time.sleep(0.05)

        with pytest.raises(ElasticError, match=r"only 1 of 3 hosts .*min_hosts=2"):
            loses()
        assert el.stats()["lost"] == ["host1", "host2"]
        el.close()


def test_a_resume_that_would_repeat_or_skip_records_is_refused():
    saved = {"records": 48, "global_batch_size": 12, "loader": {"seed": 3, "shuffle": True}}
    assert start_batch(saved, load_config(config()), "data") == 4
    assert start_batch(saved, load_config(config(global_batch_size=8)), "data") == 6
    assert start_batch(None, load_config(config()), "data") == 0
    with pytest.raises(ElasticError, match="not a whole number of global batches of 10"):
        start_batch(saved, load_config(config(global_batch_size=10)), "data")
    with pytest.raises(ElasticError, match="cuts the epochs elsewhere"):  # 234 records, not 240
        start_batch({**saved, "records": 36}, load_config(config(global_batch_size=18)), "data")
    with pytest.raises(ElasticError, match="seed=3"):
        start_batch(saved, load_config(config(seed=4)), "data")


def test_keeping_the_global_batch_takes_the_devices_that_divide_it():
    assert colocar.elastic.devices_for_batch(list(range(6)), 12) == list(range(6))
    assert colocar.elastic.devices_for_batch(list(range(6)), 16) == list(range(4))
    assert colocar.elastic.devices_for_batch(list(range(5)), 7) == [0]


def test_random_faults_are_repeatable():
    assert faults.random_kill(4, range(10), seed=5) == faults.random_kill(4, range(10), seed=5)
    drawn = {faults.random_kill(4, range(10), seed=s).host for s in range(20)}
    assert drawn <= {1, 2, 3} and len(drawn) > 1  # host 0 is spared by default
    with pytest.raises(ValueError, match="'kill' or 'stop'"):
        faults.Fault("crash", 1, 2)
