"""An array larger than 256 MiB round-trips, through shared memory and through gRPC chunks.

This is the one test with an arena above 256 MiB (it must hold the array); it uses one host.
"""

from __future__ import annotations

import numpy as np
import pytest

import colocar

MiB = 1 << 20


@colocar.colocated
def checksum_and_echo(x):
    return float(x[::4096].sum()), x


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "grpc"])
def test_array_larger_than_256_mib(shm):
    array = np.arange(80 * MiB, dtype=np.float32)  # 320 MiB
    with colocar.local_cluster(hosts=1, arena_size=704 * MiB, shm=shm, processes=0) as cluster:
        host = cluster.hosts[0]
        assert host.shm is shm
        total, back = checksum_and_echo.on(host)(array)
        assert total == float(array[::4096].sum())
        assert back.shape == array.shape and back.dtype == array.dtype
        assert np.array_equal(back, array)
        del back
