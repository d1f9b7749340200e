"""The elastic Manager under multi-controller JAX: two trainer processes (jax.distributed on
CPU), each on its own sidecar, run the Manager's loop over a global mesh with a real loader,
snapshotting every step and saving every third, each save from the blocks of the snapshot of
its step (nothing copied from the devices again); killed (SIGKILL) and started again, they
resume from the snapshot in the sidecars' RAM, bit for bit, with the data stream continued
exactly; on fresh (empty) sidecars they fall back to the newest committed storage step, saved
from a snapshot or (a step not snapshotted) from the devices.
"""

from __future__ import annotations

import json

import pytest
from checkpoint_helpers import MiB
from helpers import wait_for
from multi_helpers import run_two, stop, two_processes

PROGRAM = "elastic_multi_trainer"


def _train_then_kill(sidecars, directory: str, *extra: str, lapse: bool = True) -> list[dict]:
    """Both trainers run steps 0..6 from init (snapshots of 1..7, saves of 3 and 6; `extra`:
    snapshot every that many steps instead), then are killed mid-run; with `lapse`, their
    sessions then lapse (a test that replaces the sidecars needs no wait)."""
    trainers = two_processes(PROGRAM, sidecars, directory, "train", *extra)
    try:
        reports = []
        for t in trainers:
            lines = []
            while (line := t.stdout.readline()) and not line.startswith("ready"):
                lines.append(line)  # jax.distributed's and the loader's chatter
            if not line:
                stop(trainers)
                raise AssertionError("".join(lines)[-3000:])
            reports.append(json.loads(line.split(" ", 1)[1]))
    finally:
        stop(trainers)  # SIGKILL: no close(), the keepers stay with their snapshots
    for host in (
        sidecars.hosts if lapse else ()
    ):  # the trainers' sessions lapse (this test's and a peer's stay)
        wait_for(lambda host=host: host.stats()["sessions"] <= 2, "the killed trainers' sessions to lapse")
    return reports


def _resume(sidecars, directory: str, *extra: str) -> list[dict]:
    """Both trainers restore, check the state and every batch, and run to the end."""
    outputs = run_two(sidecars, PROGRAM, directory, "resume", *extra)
    return [json.loads(out.split("OK", 1)[1].strip().splitlines()[0]) for out in outputs]


def _replace(sidecars, h: int) -> None:
    """Host `h`'s sidecar is replaced: a new, empty one on another port."""
    sidecars.processes[h].kill()
    sidecars.processes[h].wait()
    sidecars.restart_host(h, address="127.0.0.1:0")


@pytest.mark.slow  # quick suite: the lost-host test's trainers resume from RAM (the peers' replicas)
def test_killed_trainers_resume_the_manager_loop_from_ram(make_cluster, tmp_path, cluster):
    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True, lease_seconds=5)
    directory = str(tmp_path / "ckpt")
    try:
        trained = _train_then_kill(sidecars, directory)
        for r in trained:  # from init, a snapshot per step, a save every third
            assert r["step"] == 0 and r["restored_from"] == "init", r
            assert r["counts"]["snapshot"] == 7 and r["counts"]["save"] == 2, r
            assert r["saved_from"] == {"snapshot": 2, "devices": 0}, r
            _assert_saved_from_snapshot(r)
        results = _resume(sidecars, directory)
        step = results[0]["step"]
        assert step in (6, 7)  # step 7 counts once both processes committed their part
        for r in results:  # newer than storage's step 6 or as new: RAM wins
            assert r["step"] == step and r["restored_from"] == "snapshot", r
            assert r["counts"]["restore"] == 1 and r["counts"]["snapshot"] == 12 - step, r
            assert "loss" not in r["counts"], r
    finally:
        cluster.make_current()


@pytest.mark.slow  # the quick suite restores from storage in the saves-from-snapshots test
def test_fresh_sidecars_fall_back_to_the_newest_committed_save(make_cluster, tmp_path, cluster):
    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True, lease_seconds=5)
    directory = str(tmp_path / "ckpt")
    try:
        _train_then_kill(sidecars, directory)
        for h in (0, 1):  # both replaced: no snapshot anywhere
            _replace(sidecars, h)
        results = _resume(sidecars, directory)
        for r in results:
            assert r["step"] == 6 and r["restored_from"] == "storage", r
            assert max(r["committed"]) >= 11, r  # snapshots went on after the restore
            assert r["saved_from"] == {"snapshot": 2, "devices": 0}, r  # steps 9 and 12
    finally:
        cluster.make_current()


def _assert_saved_from_snapshot(r: dict) -> None:
    """Step 6 was saved from its snapshot's blocks, with the bookkeeping a device save has."""
    assert r["saves"][-1] == "started from the snapshot (commit in the background)", r
    assert r["last_save"]["step"] == 6 and r["last_save"]["bytes"] == 0, r  # none from the devices
    assert r["last_save"]["pieces"] > 0, r
    assert r["saved_keys"] == ["['state']['acc']", "['state']['b']", "['state']['v']", "['state']['w']"], r
    meta = r["saved_meta"]["elastic"]
    assert meta["step"] == 6 and meta["keys"] == ["state"] and set(meta["data"]) == {"data"}, r


def test_saves_come_from_the_snapshots_and_restore_from_storage_continues(make_cluster, tmp_path, cluster):
    """Snapshots every other step: step 3 is saved from the devices, step 6 from its snapshot;
    on fresh sidecars the trainers restore step 6 from storage, bit for bit, and go on."""
    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True, lease_seconds=5)
    directory = str(tmp_path / "ckpt")
    try:
        trained = _train_then_kill(sidecars, directory, "2", lapse=False)
        for r in trained:
            assert r["counts"]["snapshot"] == 3 and r["counts"]["save"] == 2, r
            assert r["saved_from"] == {"snapshot": 1, "devices": 1}, r
            assert r["saves"][0] == "started from the devices (commit in the background)", r
            _assert_saved_from_snapshot(r)
        for h in (0, 1):  # both replaced: no snapshot anywhere
            _replace(sidecars, h)
        results = _resume(sidecars, directory, "2")
        for r in results:  # the state and every batch after step 6 checked by the trainers
            assert r["step"] == 6 and r["restored_from"] == "storage", r
            assert r["saved_from"] == {"snapshot": 1, "devices": 1}, r  # 9: devices, 12: snapshot
    finally:
        cluster.make_current()


def _lose_host1(sidecars, directory: str) -> dict:
    """Process 1's sidecar is killed after step 4: process 1 ends with the ElasticError (the
    job cannot shrink); both trainers are then killed, as a restart in place would."""
    trainers = two_processes(PROGRAM, sidecars, directory, "lose")
    try:
        lines = []
        while (line := trainers[1].stdout.readline()) and not line.startswith("ELASTIC"):
            lines.append(line)
        assert line, "".join(lines)[-3000:]
    finally:
        stop(trainers)
    wait_for(lambda: sidecars.hosts[0].stats()["sessions"] <= 2, "the killed trainer's session to lapse")
    return json.loads(line.split(" ", 1)[1])


def test_a_lost_host_ends_the_trainers_which_resume_from_the_peers_replicas(make_cluster, tmp_path, cluster):
    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True, lease_seconds=5)
    directory = str(tmp_path / "ckpt")
    try:
        lost = _lose_host1(sidecars, directory)
        assert "must exit and be restarted" in lost["error"], lost
        assert lost["counts"]["loss"] == 1 and lost["counts"]["fault"] == 1, lost
        _replace(sidecars, 1)  # the lost machine's replacement, empty
        results = _resume(sidecars, directory)
        step = results[0]["step"]
        assert step in (4, 5)  # step 5's replication may have died with the sidecar
        for r in results:  # host 1's shards came back from host 0's replicas, not storage
            assert r["step"] == step and r["restored_from"] == "snapshot", r
    finally:
        cluster.make_current()


def test_a_user_error_propagates_and_keeps_the_snapshots_for_the_restart(make_cluster, tmp_path, cluster):
    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True, lease_seconds=5)
    directory = str(tmp_path / "ckpt")
    try:
        trainers = two_processes(PROGRAM, sidecars, directory, "fail")
        try:
            outputs = [t.communicate(timeout=240)[0] for t in trainers]
        finally:
            stop(trainers)
        for t, out in zip(trainers, outputs, strict=True):  # not taken for a loss, not wrapped
            assert t.returncode != 0 and "RuntimeError: a bug in the training loop" in out, out[-3000:]
            assert "ElasticError" not in out, out[-3000:]
        # `with Manager` ended in an error: the snapshots stayed (storage has only step 3)
        results = _resume(sidecars, directory)
        for r in results:
            assert r["step"] in (4, 5) and r["restored_from"] == "snapshot", r
    finally:
        cluster.make_current()


def test_a_snapshot_read_failing_in_one_process_sends_every_process_to_storage(
    make_cluster, tmp_path, cluster
):
    """Host 1's keeper fails its reads (an injected fault), host 0's do not: the processes
    agree, and both restore storage step 6 bit for bit (checked by the trainers, which go on to
    step 12). First a slice read fails (the snapshot's bookkeeping, then its arrays), then the
    survey of what the keeper holds (the keepers are new: the run's end deleted them)."""
    from colocar.elastic import faults

    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True, lease_seconds=5)
    directory = str(tmp_path / "ckpt")
    try:
        _train_then_kill(sidecars, directory, lapse=False)
        faults.fail_snapshot_reads(sidecars, 1, ("blocks",))
        for r in _resume(sidecars, directory):
            assert r["step"] == 6 and r["restored_from"] == "storage", r
            assert "injected fault" in r["unusable"][0], r  # the same error in both
        faults.fail_snapshot_reads(sidecars, 1, ("holdings",))
        for r in _resume(sidecars, directory):  # storage has step 12 now
            assert r["step"] == 12 and r["restored_from"] == "storage", r
    finally:
        faults.fail_snapshot_reads(sidecars, 1, ())
        cluster.make_current()


def test_a_survivor_ends_within_seconds_of_its_peers_death(make_cluster, tmp_path, cluster, monkeypatch):
    """Process 0 waits in an exchange that process 1 never joins; process 1 is killed
    (SIGKILL): process 0 notices it from process 1's liveness beat and ends with the
    ElasticError the restart path handles, far before the 300 s sync timeout (and before
    jax.distributed's own 100 s heartbeat timeout)."""
    monkeypatch.setenv("COLOCAR_PROCESS_LOST_SECONDS", "3")  # the trainers inherit it
    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True, lease_seconds=5)
    trainers = two_processes(PROGRAM, sidecars, str(tmp_path / "ckpt"), "stall")
    try:
        for t, word in zip(trainers, ("waiting", "stalled"), strict=True):
            lines = []
            while (line := t.stdout.readline()) and line.strip() != word:
                lines.append(line)
            assert line, "".join(lines)[-3000:]
        trainers[1].kill()
        out = trainers[0].communicate(timeout=60)[0]  # today's code waited here till the deadline
        assert trainers[0].returncode == 1, out[-3000:]
        lost = json.loads(out.split("ELASTIC", 1)[1].strip().splitlines()[0])
        assert "JAX process 1 is gone" in lost["error"], lost
        assert "must exit and be restarted" in lost["error"], lost
    finally:
        stop(trainers)
        cluster.make_current()
