"""A trainer restarted in a new container (its PID cannot prove the old one dead) takes the
checkpoint lease over once the sidecar it shares with the dead trainer saw the old controller
session end, instead of being refused for the lease's whole 60 s; a live holder still refuses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
from checkpoint_helpers import MiB, drill_state
from helpers import program

import colocar
from colocar.checkpoint import CheckpointError, CheckpointManager
from colocar.checkpoint.format import layout

ROWS = 1024


def _as_if_from_another_container(directory: str) -> None:
    """Rewrites the lease as a trainer in another container would have written it."""
    path = os.path.join(directory, layout.WRITER_LEASE)
    with open(path) as f:
        holder = json.load(f)
    holder["hostname"], holder["pidns"] = "another-container", "pid:[1]"
    with open(path, "w") as f:
        json.dump(holder, f)


def _killed_after_one_save(sidecars, directory: str) -> None:
    trainer = subprocess.Popen(
        [sys.executable, program("ckpt_drill_trainer"), ",".join(h.address for h in sidecars.hosts),
         sidecars.token_file, directory, "1", "100", str(ROWS)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        while (line := trainer.stdout.readline()) and not line.startswith("saved"):
            pass
        assert line.startswith("saved"), "the trainer never saved"
    finally:
        trainer.kill()
        trainer.wait(timeout=60)
        trainer.stdout.close()


def test_a_restart_in_a_new_container_takes_the_lease_once_its_session_ended(make_cluster, tmp_path, cluster):
    sidecars = make_cluster(hosts=2, arena_size=32 * MiB, persist=True)  # session lease: 2 s
    directory = str(tmp_path / "ckpt")
    try:
        _killed_after_one_save(sidecars, directory)
        _as_if_from_another_container(directory)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m = CheckpointManager(directory, sidecars.make_current(), max_chunk_bytes=64 * 1024)
        assert not [w for w in caught if "cannot save yet" in str(w.message)], caught
        step = 50  # one the dead trainer never reached
        m.save(step, drill_state(step, 2, ROWS))  # was: refused until the lease is 60 s old
        m.wait()
        assert m.restore(step, target=None)["generation"] == 2
        m.close()
    finally:
        cluster.make_current()


def test_a_live_holder_in_another_container_still_refuses(make_cluster, tmp_path, cluster):
    sidecars = make_cluster(hosts=2, arena_size=32 * MiB)
    directory = str(tmp_path / "ckpt")
    holder = CheckpointManager(directory, sidecars.make_current(), max_chunk_bytes=64 * 1024)
    other = colocar.connect([h.address for h in sidecars.hosts], token_file=sidecars.token_file)
    try:
        holder.save(1, drill_state(1, 1, ROWS))
        holder.wait()
        _as_if_from_another_container(directory)
        with pytest.warns(RuntimeWarning, match="waits up to .* for the session"):
            second = CheckpointManager(directory, other, max_chunk_bytes=64 * 1024)
        with pytest.raises(CheckpointError, match="is being written by another CheckpointManager"):
            second.save(2, drill_state(2, 2, ROWS))  # its session stayed alive through the wait
        second.close()
    finally:
        holder.close()
        other.close()
        cluster.make_current()
