"""What a pipeline's start costs the sidecar: reading ArrayRecord files takes neither JAX nor
grain there (each takes seconds to import), in the sidecar or in its pipeline workers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from loaders_helpers import heavy_modules

import colocar
from colocar import loaders


@pytest.fixture()
def ar_pattern(tmp_path: Path) -> str:
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(tmp_path / "data-0.array_record"), "group_size:1")
    for i in range(32):
        writer.write(bytes([i]) * 8)
    writer.close()
    return str(tmp_path / "*.array_record")


def test_array_record_pipeline_imports_neither_jax_nor_grain_on_the_sidecar(ar_pattern: str) -> None:
    config = {
        "source": {"kind": "array_record", "paths": ar_pattern},
        "global_batch_size": 8,
        "transforms": [{"kind": "map", "fn": heavy_modules}],
        "workers_per_host": 1,
        "shuffle": False,
    }
    with colocar.local_cluster(hosts=1, arena_size=16 << 20, processes=0) as cluster:
        it = loaders.load(config, cluster)
        try:
            batch = next(it)
        finally:
            it.close()

        @colocar.colocated
        def loaded() -> list[str]:
            import sys

            return sorted(m for m in ("jax", "grain") if m in sys.modules)

        assert loaded.on(cluster.hosts[0])() == []
    assert np.asarray(batch["heavy"]).tolist() == [0] * 8  # the pipeline worker: neither
    assert np.asarray(batch["x"])[:, 0].tolist() == list(range(8))  # records 0-7, read


def test_the_controller_imports_no_sidecar_side_modules() -> None:
    """A training script that starts a cluster, a loader and a checkpoint manager imports
    neither the sidecar's metrics (prometheus_client) nor the pipeline's pump: they run on
    the sidecar, and each costs the training process start time and memory."""
    import subprocess
    import sys

    script = (
        "import sys, colocar; colocar.local_cluster\n"
        "from colocar import loaders; loaders.load; loaders.DataIterator\n"
        "from colocar.checkpoint import CheckpointManager, abstract\n"
        "import colocar.loaders.feed, colocar.loaders.host_backend\n"
        "heavy = ('prometheus_client', 'colocar.sidecar.metrics', 'colocar.loaders.pump', 'grain')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def _pipeline_workers(sidecar_pid: int) -> list:
    """The sidecar's pipeline workers: the children of its forkserver."""
    import psutil

    forkservers = [p for p in psutil.Process(sidecar_pid).children() if "forkserver" in " ".join(p.cmdline())]
    return [child for f in forkservers for child in f.children()]


def test_a_host_that_fails_to_start_stops_the_hosts_that_started() -> None:
    """The hosts' pipelines start in parallel; when one fails (host1 cannot open the source),
    load raises that failure and the pipeline that did start (host0's) is stopped: no worker
    is left running."""
    import time

    config = {
        "source": {"kind": "callable", "callable": "loaders_helpers:source_failing_on_host1"},
        "global_batch_size": 8,
        "workers_per_host": 2,
    }
    with colocar.local_cluster(hosts=2, arena_size=16 << 20, processes=0) as cluster:
        with pytest.raises(Exception, match="host1 cannot open the source"):
            loaders.load(config, cluster)
        deadline = time.monotonic() + 30
        while _pipeline_workers(cluster.processes[0].pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _pipeline_workers(cluster.processes[0].pid) == []
        it = loaders.load({**config, "source": {"kind": "range", "n": 64}}, cluster)
        try:
            assert np.asarray(next(it)["index"]).shape == (8,)  # the cluster still loads
        finally:
            it.close()
