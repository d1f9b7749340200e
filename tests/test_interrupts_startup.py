"""Ctrl-C at seeded random points of a loader's start-up or a checkpoint save: the next start
or save works, and no pipeline worker, arena block or writer is left (see test_interrupts.py).
"""

from __future__ import annotations

import functools
import gc
import random
from typing import Any

import jax
import numpy as np
import psutil
import pytest
from helpers import wait_for
from interrupts_helpers import (
    run_interrupted,
    settled,
    use_at_rest,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from loaders_helpers import features  # jax-free: the pipeline workers import its module

from colocar import loaders
from colocar.loaders.sampler import IndexSampler

# --- loader start-up and checkpoint saves -------------------------------------------------------
PIPELINE = {
    "source": {"kind": "range", "n": 64},
    "global_batch_size": 8,
    "transforms": [{"kind": "map", "fn": features}],
    "seed": 3,
    "num_epochs": 1,
    "workers_per_host": 1,
}


def first_batch_is_right(c: Any) -> None:
    with loaders.load(PIPELINE, c) as it:
        labels = np.asarray(next(it)["label"]).tolist()
    assert labels == IndexSampler(64, 8, seed=3, num_epochs=1).batch_indices(0).tolist()


def sidecar_descendants(c: Any) -> set[int]:
    pids = set()
    for process in c.processes:
        for child in psutil.Process(process.pid).children(recursive=True):
            try:
                if child.status() != psutil.STATUS_ZOMBIE:
                    pids.add(child.pid)
            except psutil.Error:
                pass
    return pids


def _interrupt_loader_start(seed: int, c: Any, cases: int) -> None:
    rng = random.Random(seed)
    baseline = use_at_rest(c)  # before any loader: a closed one gives its blocks back in the background
    first_batch_is_right(c)  # starts the forkservers: part of the baseline
    gc.collect()
    processes = sidecar_descendants(c)
    for _ in range(cases):
        interrupted, it = run_interrupted(lambda: loaders.load(PIPELINE, c), rng.uniform(0, 1.5))
        if it is not None:
            it.close()
        del it
        first_batch_is_right(c)
    settled(c, baseline)
    wait_for(lambda: sidecar_descendants(c) == processes, "the pipeline workers to exit")


def test_interrupted_loader_start_up(make_cluster):
    _interrupt_loader_start(0, make_cluster(hosts=2, processes=0, arena_size=32 << 20), cases=2)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 6))
def test_interrupted_loader_start_up_many_seeds(seed, make_cluster):
    _interrupt_loader_start(seed, make_cluster(hosts=2, processes=0, arena_size=32 << 20), cases=8)


def _interrupt_saves(seed: int, c: Any, directory: str, cases: int) -> None:
    from colocar.checkpoint import CheckpointManager

    rng = random.Random(seed)
    mesh = c.mesh(("data",))
    sharding = NamedSharding(mesh, P("data"))
    baseline = use_at_rest(c)
    mngr = CheckpointManager(directory, c, stale_seconds=0.5)
    try:
        for step in range(cases):
            state = {"w": jax.device_put(np.full((256, 1024), step, np.float32), sharding), "step": step}
            run_interrupted(functools.partial(mngr.save, 2 * step, state), rng.uniform(0, 0.3))
            assert mngr.save(2 * step + 1, state)  # the next save works, and saves its own state
            mngr.wait()
            restored = mngr.restore(2 * step + 1, target={"w": state["w"], "step": 0})
            assert restored["step"] == step
            assert (np.asarray(restored["w"]) == step).all()
            del state, restored
    finally:
        mngr.close()
    settled(c, baseline)


def test_interrupted_checkpoint_saves(make_cluster, tmp_path):
    _interrupt_saves(0, make_cluster(hosts=2, processes=0, arena_size=32 << 20), str(tmp_path / "c"), 3)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 6))
def test_interrupted_checkpoint_saves_many_seeds(seed, make_cluster, tmp_path):
    _interrupt_saves(seed, make_cluster(hosts=2, processes=0, arena_size=32 << 20), str(tmp_path / "c"), 8)
