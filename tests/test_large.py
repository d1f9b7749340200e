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


@colocar.colocated
def size(value):
    return len(value)


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


@colocar.colocated
def repeat(value, times):
    return value * times


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "grpc"])
def test_pickled_values_over_the_message_limit_travel_like_arrays(shm):
    """A large non-array value (bytes, lists) goes through a block or chunks, never in a
    message: over gRPC's 64 MiB limit too. An arena too small for it says so."""
    with colocar.local_cluster(hosts=1, arena_size=160 * MiB, shm=shm, processes=0) as cluster:
        host = cluster.hosts[0]
        assert size.on(host)(b"x" * (65 * MiB)) == 65 * MiB
        assert size.on(host)(list(range(3 * MiB))) == 3 * MiB
        back = repeat.on(host)(b"xy", 33 * MiB)
        assert len(back) == 66 * MiB and back[:4] == b"xyxy"
        del back
        with pytest.raises(colocar.shm.ArenaFullError, match="cannot hold"):
            size.on(host)(b"x" * (200 * MiB))
        assert size.on(host)(b"xy") == 2  # the host still answers
