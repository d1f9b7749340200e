"""Clusters: device splitting, meshes, connect() by address and env, persistent sidecars."""

from __future__ import annotations

import os
import signal

import jax
import numpy as np
import psutil
import pytest
from helpers import program

import colocar


@colocar.colocated
def pid():
    import os

    return os.getpid()


def test_hosts_split_devices_host_major(cluster):
    devices = jax.devices()
    assert [h.devices for h in cluster.hosts] == [devices[:4], devices[4:]]
    assert cluster.devices == devices
    mesh = cluster.mesh(("a", "b"), shape=(4, 2))
    assert mesh.devices.shape == (4, 2) and list(mesh.devices.flat) == devices
    with pytest.raises(ValueError, match="mesh shape"):
        cluster.mesh(("a",), shape=(3,))


def test_local_cluster_on_chosen_devices():
    devices = jax.devices()[2:6]
    with colocar.local_cluster(hosts=2, devices=devices, arena_size=16 << 20, processes=0) as c:
        assert [h.devices for h in c.hosts] == [devices[:2], devices[2:]]
    with pytest.raises(ValueError, match="evenly"):
        colocar.local_cluster(hosts=3, devices=devices)


def test_connect_by_address_and_env(cluster, monkeypatch):
    token = open(cluster.token_file).read()
    addresses = [h.address for h in cluster.hosts]
    with colocar.connect(addresses, token=token) as other:
        assert pid.on(other.hosts)() == pid.on(cluster.hosts)()
        assert all(h.shm for h in other.hosts)
    monkeypatch.setenv("COLOCAR_SIDECARS", ",".join(addresses))
    monkeypatch.setenv("COLOCAR_TOKEN_FILE", cluster.token_file)
    with colocar.connect(shm=False) as other:
        assert not any(h.shm for h in other.hosts)
        assert pid.on(other.hosts[1])() == pid.on(cluster.hosts[1])()
    monkeypatch.delenv("COLOCAR_SIDECARS")
    with pytest.raises(colocar.ColocarError, match="COLOCAR_SIDECARS"):
        colocar.connect()


def test_persistent_sidecars_outlive_the_cluster(shm_dir):
    first = colocar.local_cluster(hosts=1, arena_size=16 << 20, processes=0, persist=True)
    process = first.processes[0]
    address, token_file = first.hosts[0].address, first.token_file
    arena = first.hosts[0].connection.session.info.arena_path
    try:
        first_pid = pid.on(first.hosts[0])()
        first.close()
        assert process.poll() is None, "a persistent sidecar must keep running after close()"
        with colocar.connect([address], token_file=token_file) as again:
            assert pid.on(again.hosts[0])() == first_pid
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        workdir = os.path.dirname(token_file)
        for name in os.listdir(workdir):
            os.unlink(os.path.join(workdir, name))
        os.rmdir(workdir)
    assert process.returncode == 0 and not os.path.exists(arena)


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_sidecars_exit_with_their_controller(how):
    """A controller that ends without closing its cluster (its script ends, or it is killed)
    leaves no sidecar and no arena behind; one that exits leaves no work folder either, and
    says nothing on the way out (a future dropped unread at exit once printed a traceback)."""
    import subprocess
    import sys

    from helpers import wait_for

    controller = subprocess.Popen(
        [sys.executable, program("cluster_controller")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        sidecar_pid, arena, workdir = controller.stdout.readline().split()
        sidecar = psutil.Process(int(sidecar_pid))
        if how == "exit":
            controller.stdin.close()  # the script reads stdin to its end, then ends
            assert controller.wait(timeout=30) == 0
            err = controller.stderr.read()
            assert "Traceback" not in err and "Exception ignored" not in err, err
        else:
            controller.kill()
            controller.wait(timeout=30)

        def gone() -> bool:
            try:
                return sidecar.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        wait_for(gone, "the sidecar to end with its controller")
        assert not os.path.exists(arena)
        if how == "exit":
            assert not os.path.exists(workdir)
    finally:
        controller.kill()
        controller.wait(timeout=30)


def test_stats_have_named_fields(cluster):
    stats = cluster.hosts[0].stats()
    for key in ("calls", "errors", "latency_p50_us", "latency_p99_us", "sessions", "objects", "in_flight"):
        assert key in stats
    pool = stats["pools"]["default"]
    assert pool["reserved"] > 0 and set(pool) >= {"used", "peak", "blocks", "largest_free"}
    assert np.isfinite(stats["uptime_seconds"])


def test_a_sidecar_that_cannot_start_fails_local_cluster_at_once_with_its_log(tmp_path):
    """The sidecars say they are ready on a pipe; one that exits first (here: a pool larger
    than its arena) ends that pipe, and local_cluster raises at once with the sidecar's log."""
    import time

    from colocar.errors import ColocarError

    started = time.monotonic()
    with pytest.raises(ColocarError, match=r"sidecar host\d failed to start:(.|\n)*pool"):
        colocar.local_cluster(
            hosts=2, arena_size=16 << 20, pools={"big": 64 << 20}, shm_dir=str(tmp_path), processes=0
        )
    assert time.monotonic() - started < 60  # not the 120 s startup timeout


def test_a_closed_cluster_gives_no_warning(recwarn):
    c = colocar.local_cluster(hosts=1, arena_size=16 << 20, processes=0)
    processes = list(c.processes)
    c.close()
    del c
    import gc

    gc.collect()
    from colocar.controller_bridge.local import ClusterDroppedWarning

    assert not [w for w in recwarn if w.category is ClusterDroppedWarning]
    assert all(p.poll() is not None for p in processes)
