"""Notebook use: re-running `cluster = colocar.local_cluster(...)` must not pile up sidecars.

A cluster nobody holds any more shuts its sidecars down (and says so with a warning); closing
the last one leaves no process and no arena of any of them.
"""

from __future__ import annotations

import gc
import os
import time

import pytest

import colocar
from colocar.controller_bridge.local import ClusterDroppedWarning

MiB = 1 << 20


def _wait_gone(processes: list, arenas_dir: str, keep: int, deadline_s: float = 60.0) -> None:
    """Waits (generously) until every process has exited and `keep` arena files remain."""
    deadline = time.monotonic() + deadline_s
    while any(p.poll() is None for p in processes) or len(_arenas(arenas_dir)) > keep:
        assert time.monotonic() < deadline, (
            [p.pid for p in processes if p.poll() is None],
            _arenas(arenas_dir),
        )
        time.sleep(0.05)


def _arenas(directory: str) -> list[str]:
    return [name for name in os.listdir(directory) if name.endswith(".arena")]


def test_rerunning_a_cell_shuts_the_replaced_clusters_down(shm_dir: str) -> None:
    arenas_dir = os.path.join(shm_dir, "notebook")
    os.makedirs(arenas_dir)
    made: list[list] = []
    options = dict(hosts=2, arena_size=16 * MiB, processes=0, shm_dir=arenas_dir)
    try:
        with pytest.warns(ClusterDroppedWarning, match="dropped without close") as caught:
            for _ in range(3):  # the cell, run three times
                cluster = colocar.local_cluster(**options)  # type: ignore[arg-type]
                made.append(list(cluster.processes))
                gc.collect()
        assert len([w for w in caught if w.category is ClusterDroppedWarning]) == 2
        _wait_gone(made[0] + made[1], arenas_dir, keep=2)
        assert all(p.poll() is None for p in made[2])  # the live one is untouched
        assert colocar.controller_bridge.cluster.current_cluster() is cluster
        cluster.close()
        _wait_gone(made[2], arenas_dir, keep=0)
    finally:
        for processes in made:
            for p in processes:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=30)
        for name in os.listdir(arenas_dir):
            os.unlink(os.path.join(arenas_dir, name))
        os.rmdir(arenas_dir)


def test_a_closed_cluster_gives_no_warning(recwarn: pytest.WarningsRecorder) -> None:
    c = colocar.local_cluster(hosts=1, arena_size=16 * MiB, processes=0)
    processes = list(c.processes)
    c.close()
    del c
    gc.collect()
    assert not [w for w in recwarn if w.category is ClusterDroppedWarning]
    assert all(p.poll() is not None for p in processes)
