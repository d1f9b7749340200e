"""A JAX process that skips a collective colocar call (a bug in the training loop) under
multi-controller JAX: the others raise within a bounded wait, naming the process and the call,
and nothing of different calls is put together. (Array calls and loaders: test_calls_multi.py,
test_loaders_multi.py; process 0 skipping its only save: test_checkpoint_multi.py.)
"""

from __future__ import annotations

import os

from checkpoint_helpers import MiB
from multi_helpers import run_two

from colocar.checkpoint.format import layout


def test_a_save_one_process_skips_commits_nothing_and_names_it(make_cluster, tmp_path, cluster):
    """Process 0 skips step 2 and saves step 3; process 1 saves both. Process 0's save of step 3
    fails naming host (process) 1 and the step; process 1's step 2 is never committed, and its
    step 3 fails waiting for process 0's start of it: no step is committed (each save is
    numbered in each process: process 1's step 2 took process 0's step 3's attempt before)."""
    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True)
    directory = str(tmp_path / "skipped")
    try:
        outputs = run_two(sidecars, "ckpt_multi_skips", directory, "3", "2,3")
    finally:
        cluster.make_current()
    first, second = outputs
    assert "failed: 3 CheckpointError" in first, first[-3000:]
    assert "hosts [1] did not report their part of step 3 done within 2 s" in first, first[-3000:]
    assert "failed: 2 CheckpointError" in second and "failed: 3 CheckpointError" in second, second[-3000:]
    assert "process 0 did not start its save of step 3 within commit_timeout (2 s)" in second, second[-3000:]
    assert "step 2 was not committed within commit_timeout (2 s)" in second, second[-3000:]
    assert not [line for line in (first + second).splitlines() if line.startswith("committed")]
    for step in (2, 3):
        assert not os.path.exists(os.path.join(directory, layout.step_dir(step), layout.COMMITTED))
