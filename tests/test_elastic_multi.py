"""Multi-controller snapshots: two JAX processes (jax.distributed on CPU), each snapshotting its
own shards into its own sidecar with a replica on the other's, are killed (SIGKILL) and started
again: they find the sidecars still holding the snapshots, agree on the newest one complete
everywhere and restore it from RAM, bit for bit; a sidecar replaced by an empty one meanwhile
gets its shards back from the peer's replicas. They also restore onto other shardings and
meshes (parts of the peer's shards read keeper to keeper), and `save_to` writes a snapshot to
storage from the sidecars' blocks as a committed step that CheckpointManager restores.
"""

from __future__ import annotations

import json
import os

import pytest
from checkpoint_helpers import MiB
from helpers import wait_for
from multi_helpers import processes, stop, two_processes


def _train_then_kill(sidecars, directory: str, lapse: bool = True) -> None:
    """Both trainers snapshot steps 1-5 (4 waited for), then are killed mid-run; with
    `lapse`, their sessions then lapse, the snapshots staying (else the restart comes within
    the lease, as a quickly restarted job's does)."""
    trainers = two_processes("snap_multi_trainer", sidecars, directory, "train")
    try:
        for t in trainers:
            line = t.stdout.readline()
            if not line.startswith("ready"):
                _ended(t)  # a failed trainer's traceback is still being written
                stop(trainers)
                raise AssertionError((line + t.stdout.read())[-3000:])
            assert 4 in json.loads(line.split(" ", 1)[1]), line
    finally:
        stop(trainers)  # SIGKILL: no close(), the keepers stay with their snapshots
    for host in sidecars.hosts if lapse else ():  # the trainers' sessions lapse; the snapshot blocks stay
        # left: this test's session and the one the peer's keeper opened to send its replicas
        wait_for(lambda host=host: host.stats()["sessions"] == 2, "the killed trainers' sessions to lapse")
        # each of the two steps kept: its own shards packed in one block (the take's), and the
        # peer's replicas in another (small pieces sent in one call share a block)
        assert host.stats()["pools"]["default"]["blocks"] >= 4, host.stats()


def test_a_snapshot_still_replicating_when_the_trainers_die_counts_once_it_ends(
    make_cluster, tmp_path, cluster
):
    """Step 5 is taken while the test holds replication back, and both trainers are killed
    before it ends: the keepers commit the records the trainers handed them once their shards
    are replicated, so the restart resumes from step 5 (before, only a living trainer committed
    its part, and a kill after a take lost two snapshot intervals)."""
    from colocar.elastic import faults

    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True, lease_seconds=5)
    directory = str(tmp_path / "unused")
    try:
        trainers = two_processes("snap_multi_trainer", sidecars, directory, "held")
        try:
            for t in trainers:
                assert t.stdout.readline().startswith("ready"), t.stdout.read()[-3000:]
            for h in (0, 1):
                faults.hold_replication(sidecars, h)
            for t in trainers:
                t.stdin.write("go\n")
                t.stdin.flush()
            for t in trainers:
                line = t.stdout.readline()
                assert line.startswith("taken") and 5 not in json.loads(line.split(" ", 1)[1]), line
        finally:
            stop(trainers)  # SIGKILL while step 5 waits to replicate
        for h in (0, 1):
            faults.hold_replication(sidecars, h, held=False)
        for host in sidecars.hosts:
            keeper = host.object(f"colocar.snapshots/mc-test/{sidecars.hosts.index(host)}")
            wait_for(lambda k=keeper: k.holdings_by_source()[5]["own"][0] is not None, "step 5's records")
        results = _resume(sidecars, directory)
        assert [r["step"] for r in results] == [5, 5]
    finally:
        cluster.make_current()


def _ended(trainer) -> None:
    try:
        trainer.wait(timeout=30)
    except Exception:  # noqa: BLE001 - still running: stopped next
        pass


def _resume(sidecars, directory: str, mode: str = "resume") -> list[dict]:
    """Both trainers restore (and, "resume", take the next step and end; "hold", are killed
    once restored, leaving their keepers as the restore made them)."""
    trainers = two_processes("snap_multi_trainer", sidecars, directory, mode)
    try:
        if mode == "hold":
            outputs = [_until_ok(t) for t in trainers]
        else:
            outputs = [t.communicate(timeout=120)[0] for t in trainers]
            for t, out in zip(trainers, outputs, strict=True):
                assert t.returncode == 0 and "OK" in out, out[-3000:]
    finally:
        stop(trainers)
    return [json.loads(out.split("OK", 1)[1].strip().splitlines()[0]) for out in outputs]


def _until_ok(trainer) -> str:
    lines = []
    while (line := trainer.stdout.readline()) and not line.startswith("OK"):
        lines.append(line)
    assert line, "".join(lines)[-3000:]
    return line


def _replace(sidecars, h: int) -> None:
    """Host `h`'s sidecar is replaced: a new, empty one on another port."""
    sidecars.processes[h].kill()
    sidecars.processes[h].wait()
    old = sidecars.hosts[h].address
    sidecars.restart_host(h, address="127.0.0.1:0")
    assert sidecars.hosts[h].address != old


@pytest.mark.slow  # the quick suite resumes in place from RAM in the reshard test's first restart
def test_killed_trainers_resume_from_the_sidecars_ram(make_cluster, tmp_path, cluster):
    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True, lease_seconds=5)
    directory = str(tmp_path / "unused")
    try:
        _train_then_kill(sidecars, directory)
        results = _resume(sidecars, directory)
        assert results[0]["step"] == results[1]["step"] in (4, 5)  # step 5 counts if both committed
        assert [r["refilled_bytes"] for r in results] == [0, 0]  # nothing was lost: read in place
        assert [r["fetched"] for r in results] == [0, 0]  # the saved layout: nothing from the peer
        assert not os.path.exists(directory)  # no storage anywhere: it came from RAM
    finally:
        cluster.make_current()


def test_a_replaced_sidecar_gets_its_shards_back_from_the_peer(make_cluster, tmp_path, cluster):
    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True, lease_seconds=5)
    directory = str(tmp_path / "unused")
    try:
        _train_then_kill(sidecars, directory)
        _replace(sidecars, 1)
        results = _resume(sidecars, directory, "hold")
        step = results[0]["step"]
        assert step == results[1]["step"] in (4, 5)
        # process 0's keeper sent process 1's shards back, and its own shards as replicas again
        assert results[0]["refilled_bytes"] > 0 and results[1]["refilled_bytes"] == 0
        # so the next loss is covered: with host 0 replaced now, host 1 alone holds the step
        _replace(sidecars, 0)
        results = _resume(sidecars, directory)
        assert [r["step"] for r in results] == [step, step]
        assert results[0]["refilled_bytes"] == 0 and results[1]["refilled_bytes"] > 0
    finally:
        cluster.make_current()


def test_restart_restores_onto_other_shardings(make_cluster, tmp_path, cluster):
    """Onto other partition specs and another mesh of the same devices: each process's devices
    need parts of the other's shards, which its keeper fetches from the peer's."""
    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True, lease_seconds=5)
    directory = str(tmp_path / "unused")
    try:
        _train_then_kill(sidecars, directory, lapse=False)  # restarted within the lease
        results = _resume(sidecars, directory, "reshard")
        assert results[0]["step"] == results[1]["step"] in (4, 5)
        assert [r["refilled_bytes"] for r in results] == [0, 0]
        # the saved layout read in place, the others partly from the peer's keeper
        assert all(r["fetched"][0] == 0 < r["fetched"][1] for r in results), results
        _replace(sidecars, 0)  # an empty sidecar: refilled from the peer, then resharded
        results = _resume(sidecars, directory, "reshard")
        # process 1's keeper sent process 0's shards back (its bytes count where sent)
        assert results[0]["refilled_bytes"] == 0 and results[1]["refilled_bytes"] > 0
    finally:
        cluster.make_current()


# quick suite: test_elastic_manager_multi saves from the snapshots and restores from storage
@pytest.mark.slow
def test_save_to_writes_a_committed_checkpoint_from_the_sidecars(make_cluster, tmp_path, cluster):
    """After a restart, with one sidecar replaced by an empty one: `save_to` refills it, then
    each process's sidecar writes its replica-0 shards; CheckpointManager restores the step
    bit for bit, in the saved layout and another one."""
    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True, lease_seconds=5)
    directory = str(tmp_path / "ckpt")
    try:
        _train_then_kill(sidecars, directory)
        _replace(sidecars, 1)
        results = _resume(sidecars, directory, "save")
        assert results[0]["step"] == results[1]["step"] in (4, 5)
        assert results[0]["refilled_bytes"] > 0
        # each process's sidecar wrote its own part from the blocks; nothing came from the devices
        assert all(r["pieces"] > 0 and r["device_bytes"] == 0 for r in results), results
        assert os.listdir(directory)  # the committed step is in storage
    finally:
        cluster.make_current()


def _job(sidecars, count: int, mode: str) -> list:
    """tests/programs/snap_mc_shrink.py as `count` JAX processes on the first sidecars."""
    return processes("snap_mc_shrink", sidecars, "unused", count, mode, str(count))


def test_a_job_restarted_without_the_lost_host_reads_its_shards_from_the_replicas(make_cluster, cluster):
    """Three processes snapshot (each host's shards replicated on the next); host 2 is lost
    and the job restarts on the other two, onto their devices: the shards of host 2 exist
    only as host 0's replicas, and come from there, bit for bit (before, only owners were
    read and the restart fell back to storage)."""
    import jax

    devices = jax.devices()[:6]  # the trainers' own; three sidecars need a share that splits
    sidecars = make_cluster(hosts=3, devices=devices, arena_size=16 * MiB, persist=True, lease_seconds=5)
    try:
        trainers = _job(sidecars, 3, "train")
        try:
            for t in trainers:
                line = t.stdout.readline()
                if not line.startswith("ready"):
                    _ended(t)
                    raise AssertionError((line + t.stdout.read())[-3000:])
                assert 3 in json.loads(line.split(" ", 1)[1]), line
        finally:
            stop(trainers)
        sidecars.processes[2].kill()  # host 2 is lost with its sidecar
        sidecars.processes[2].wait()
        resumed = _job(sidecars, 2, "resume")
        try:
            outputs = [t.communicate(timeout=180)[0] for t in resumed]
        finally:
            stop(resumed)
        for t, out in zip(resumed, outputs, strict=True):
            assert t.returncode == 0 and "OK" in out, out[-3000:]
        results = [json.loads(out.split("OK", 1)[1].strip().splitlines()[0]) for out in outputs]
        assert [r["step"] for r in results] == [3, 3]
        # host 2's shards stay where they are; process 1's go to its new replica peer, process 0
        assert results[0]["refilled_bytes"] == 0 < results[1]["refilled_bytes"], results
        # process 1's devices need rows 6-11 of w and h: 8-11 of them were host 2's
        assert results[1]["fetched"] > 0, results
    finally:
        cluster.make_current()
