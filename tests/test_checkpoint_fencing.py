"""The guards that keep a dead trainer's writers from committing over a new lease holder, and
a commit from covering a step without its manifest: the sidecar writer (`CheckpointWriter`,
run here in the test process on real storage), the lease, and `StepDirs.commit`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

from colocar.checkpoint import CheckpointError, CheckpointManager
from colocar.checkpoint.backends.fencing import fence_writers
from colocar.checkpoint.backends.writer import CheckpointWriter, WriterOptions
from colocar.checkpoint.format import layout
from colocar.checkpoint.store.steps import StepDirs
from colocar.checkpoint.store.storage import open_storage
from colocar.pids import pid_namespace


def _lease(directory, **holder) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, layout.WRITER_LEASE), "w") as f:
        json.dump({"owner": "other", "time": time.time(), **holder}, f)


def _primary_waiting_for_host_1(directory: str, owner: str) -> CheckpointWriter:
    """Host 0's writer of `owner` with step 2 begun (no arrays), its own part done: its commit
    waits only for host 1's done marker."""
    writer = CheckpointWriter(directory, 0, WriterOptions(owner=owner, commit_timeout=60))
    manifest = {"format": layout.FORMAT, "step": 2, "attempt": "old", "leaves": {}, "tree": None}
    writer.begin(2, json.dumps(manifest).encode(), [0, 1], True)
    writer.finish(2, 0)
    return writer


def test_a_fenced_writer_never_commits(tmp_path):
    directory = str(tmp_path / "fenced")
    writer = _primary_waiting_for_host_1(directory, "dead-trainer")
    assert fence_writers(directory, "new-holder") == 1
    StepDirs(open_storage(directory)).mark_done(2, 1, "old", 0, 0)  # host 1's late done marker
    status = writer.wait(2, timeout=60)
    assert status["state"] == "failed" and "took over the lease" in status["error"]
    assert not os.path.exists(os.path.join(directory, layout.step_dir(2), layout.COMMITTED))
    assert fence_writers(directory, "new-holder") == 0  # nothing left to stop
    writer.close()


def test_processes_sharing_a_sidecar_fence_only_earlier_lease_holders(tmp_path):
    """Multi-controller processes of one job may share a sidecar: the leader taking the lease
    fences the writers of the manager that committed before it, not its siblings' writers."""
    directory = str(tmp_path / "shared")
    old_leader = _primary_waiting_for_host_1(directory, "old-leader")
    sibling = CheckpointWriter(directory, 1, WriterOptions(owner="sibling"))
    manifest = {"format": layout.FORMAT, "step": 5, "attempt": "new", "leaves": {}, "tree": None}
    sibling.begin(5, json.dumps(manifest).encode(), [0, 1], False)
    assert fence_writers(directory, "new-leader", everyone=False) == 1
    assert old_leader.wait(2)["state"] == "failed"
    assert sibling.wait(5)["state"] == "writing"
    sibling.finish(5, 0)
    assert sibling.wait(5, timeout=60)["state"] == "done"
    old_leader.close()
    sibling.close()


@pytest.mark.parametrize("holder", ["dead-trainer", "new-holder"])
def test_a_writer_commits_only_while_its_manager_holds_the_lease(tmp_path, holder):
    """A writer the new holder could not reach (other sidecars) checks the lease before it
    commits: it commits only if the lease still names its own manager."""
    directory = str(tmp_path / "lease")
    _lease(directory, owner=holder)
    writer = _primary_waiting_for_host_1(directory, "dead-trainer")
    StepDirs(open_storage(directory)).mark_done(2, 1, "old", 0, 0)
    status = writer.wait(2, timeout=60)
    committed = os.path.exists(os.path.join(directory, layout.step_dir(2), layout.COMMITTED))
    if holder == "dead-trainer":
        assert status["state"] == "committed" and committed
    else:
        assert status["state"] == "failed" and "holds the lease" in status["error"] and not committed
    writer.close()


def test_no_commit_marker_without_the_attempts_manifest(tmp_path):
    steps = StepDirs(open_storage(str(tmp_path / "nomanifest")))
    with pytest.raises(RuntimeError, match="manifest of step 3 .*missing"):
        steps.commit(3, "a", [0])
    assert not steps.is_committed(3)


def test_lease_of_a_dead_holder_on_this_host_is_taken_over_at_once(cluster, tmp_path):
    """The holder ran here and its process is gone: no 60 s wait, no warning."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    directory = str(tmp_path / "dead")
    _lease(directory, hostname=socket.gethostname(), pid=gone.pid, pidns=pid_namespace())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = CheckpointManager(directory, cluster, lease_seconds=600)
    m.save(1, {"x": np.arange(3)})
    m.wait()
    assert m.all_steps() == [1]
    m.close()


def test_lease_of_a_live_holder_is_reported_when_the_manager_is_made(cluster, tmp_path):
    """A fresh lease of a holder on another host (whose death cannot be decided here) is
    reported at once, and the save is refused naming it."""
    directory = str(tmp_path / "live")
    _lease(directory, hostname="elsewhere", pid=os.getpid())
    with pytest.warns(RuntimeWarning, match="cannot save yet: .* on elsewhere"):
        m = CheckpointManager(directory, cluster, lease_seconds=600)
    with pytest.raises(CheckpointError, match="another CheckpointManager .* on elsewhere"):
        m.save(1, {"x": np.arange(3)})
    m.close()


def test_a_format_1_step_still_restores(cluster, tmp_path):
    """Steps written before attempt directories (format 1: manifest, markers and arrays
    directly in the step directory) restore as before."""
    directory = str(tmp_path / "format1")
    state = {"x": np.arange(12, dtype=np.int32), "note": "old"}
    m = CheckpointManager(directory, cluster)
    m.save(1, state)
    m.wait()
    m.close()
    step = os.path.join(directory, layout.step_dir(1))
    (attempt,) = [n for n in os.listdir(step) if n.startswith(layout.ATTEMPT_PREFIX)]
    for name in os.listdir(os.path.join(step, attempt)):
        os.rename(os.path.join(step, attempt, name), os.path.join(step, name))
    os.rmdir(os.path.join(step, attempt))
    manifest = json.load(open(os.path.join(step, layout.MANIFEST)))
    json.dump({**manifest, "format": layout.FORMAT_1}, open(os.path.join(step, layout.MANIFEST), "w"))
    reader = CheckpointManager(directory, cluster)
    restored = reader.restore(1)
    assert np.array_equal(restored["x"], state["x"]) and restored["note"] == "old"
    reader.close()
