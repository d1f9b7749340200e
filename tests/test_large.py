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


@pytest.mark.xfail(
    strict=True,
    reason="a pickled value over the 64 MiB message limit (not an array: those go through blocks) "
    "breaks the local link and loses the host with shm, and raises ArenaFullError without shm; "
    "found by the parity work on issue 13, left to the owner of the link (section 2 edits it)",
)
@pytest.mark.parametrize("shm", [True, False], ids=["shm", "grpc"])
def test_pickled_value_over_the_message_limit_fails_cleanly(shm):
    with colocar.local_cluster(hosts=1, arena_size=4 * MiB, shm=shm, processes=0) as cluster:
        host = cluster.hosts[0]
        with pytest.raises(colocar.ColocarError) as failure:
            size.on(host)(b"x" * (65 * MiB))
        assert not isinstance(failure.value, colocar.HostLostError | colocar.shm.ArenaFullError)
        assert size.on(host)(b"xy") == 2  # the host still answers
