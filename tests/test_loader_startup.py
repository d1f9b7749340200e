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
