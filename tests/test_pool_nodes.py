"""A shared pool spanning machines: `colocar pool node` on each, `colocar pool up --nodes`.

The nodes are real processes on this machine, each standing for a machine of its own (its own
arena folder and machine name); the agent starts a tenant's sidecar on every node, host i on
node i. Tested: a job's calls run on the nodes' sidecars; a multi-controller job (two
jax.distributed processes) gets, in each process, the sidecar on its own machine; a node that
dies stops its tenants everywhere; an agent that dies leaves nothing running on the nodes;
a wrong node token is refused and starts nothing; `pool down` leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

import grpc
import psutil
import pytest
from helpers import program, wait_for
from pool_helpers import LiveNodes, LivePool

import colocar
from colocar.errors import ColocarError
from colocar.protocol import colocar_pb2 as pb
from colocar.protocol import colocar_pb2_grpc as pb_grpc
from colocar.protocol.tokens import TOKEN_METADATA_KEY

TENANTS = {"ann": {"quotas": {"arena": "8M"}}, "bob": {"quotas": {"arena": "8M"}}}


@colocar.colocated
def ancestors() -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process().parents()]


@pytest.fixture
def node_shm(shm_dir):
    """An arena folder of this test's own: the session's clusters keep theirs in `shm_dir`."""
    folder = tempfile.mkdtemp(prefix="nodes-", dir=shm_dir)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _on_nodes(tmp_path, shm_dir, count: int = 2, machines=None, pool_flags=None, **node_flags):
    nodes = LiveNodes(str(tmp_path / "nodes"), shm_dir, count, machines, **node_flags).up()
    try:
        pool = LivePool(
            str(tmp_path / "pool"), shm_dir, TENANTS, nodes=nodes.addresses, node_token_file=nodes.token_file,
            **(pool_flags or {}),
        ).up()  # fmt: skip
    except BaseException:
        nodes.down()
        raise
    return nodes, pool


def _tenant_sidecars(nodes: LiveNodes, i: int) -> list[psutil.Process]:
    """Node i's running tenant sidecars (one that exited but is not reaped yet counts as gone)."""
    found = []
    for p in psutil.Process(nodes.pid(i)).children():
        try:
            if "colocar.sidecar" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:  # a zombie, or gone
            pass
    return found


def test_a_pool_spans_nodes_host_i_on_node_i_and_down_leaves_nothing(tmp_path, node_shm):
    nodes, pool = _on_nodes(tmp_path, node_shm)
    try:
        with colocar.connect(pool=pool.pool_file, token_file=pool.token_file("ann")) as ann:
            assert len(ann.hosts) == 2
            for i, host in enumerate(ann.hosts):
                assert nodes.pid(i) in ancestors.on(host)()  # its sidecar is node i's child
            assert ann.stats()["pool"]["tenant"] == "ann"
        status = pool.status()
        assert status["hosts"] == 2 and status["tenants"]["ann"]["served"]
        assert all(len(_tenant_sidecars(nodes, i)) == 1 for i in range(2))
        pool.down()
        for i in range(2):  # the nodes outlive the pool's agent; the tenants' sidecars do not
            wait_for(lambda i=i: not _tenant_sidecars(nodes, i), f"node {i}'s tenant sidecars to stop")
        assert [f for f in os.listdir(node_shm) if f.endswith(".arena")] == []
    finally:
        pool.down()
        nodes.down()


def test_each_process_of_a_multi_controller_job_gets_the_sidecar_on_its_machine(tmp_path, node_shm):
    nodes, pool = _on_nodes(tmp_path, node_shm, machines=["m0", "m1"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    on = ["m1", "m0"]  # process 0 runs on the machine of node 1: it must get node 1's sidecar
    token = pool.token_file("bob")
    jobs = [
        subprocess.Popen(
            [sys.executable, program("pool_multi"), str(i), port, pool.pool_file, token, on[i]],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outputs = [j.communicate(timeout=240)[0] for j in jobs]
        for job, out in zip(jobs, outputs, strict=True):
            assert job.returncode == 0 and "OK" in out, out[-3000:]
        results = [json.loads(out.split("RESULT ", 1)[1].splitlines()[0]) for out in outputs]
        assert nodes.pid(1) in results[0]["ancestors"] and nodes.pid(0) not in results[0]["ancestors"]
        assert nodes.pid(0) in results[1]["ancestors"] and nodes.pid(1) not in results[1]["ancestors"]
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
                job.wait()
        pool.down()
        nodes.down()


def test_a_node_that_dies_stops_its_tenant_on_every_node(tmp_path, node_shm):
    nodes, pool = _on_nodes(tmp_path, node_shm)
    try:
        with colocar.connect(pool=pool.pool_file, token_file=pool.token_file("ann")):
            pass
        sidecar_on_1 = _tenant_sidecars(nodes, 1)
        os.kill(nodes.pid(1), signal.SIGKILL)
        wait_for(lambda: not pool.status()["tenants"]["ann"]["served"], "ann to be stopped")
        wait_for(lambda: not _tenant_sidecars(nodes, 0), "ann's sidecar on node 0 to stop")
        psutil.wait_procs(sidecar_on_1, timeout=60)  # its parent gone, the sidecar ends itself
        assert not any(p.is_running() for p in sidecar_on_1)
        with pytest.raises(ColocarError, match="pool node"):  # its next job is told why
            colocar.connect(pool=pool.pool_file, token_file=pool.token_file("ann"))
    finally:
        pool.down()
        nodes.down()


def test_an_agent_that_dies_leaves_nothing_running_on_the_nodes(tmp_path, node_shm):
    nodes, pool = _on_nodes(tmp_path, node_shm, agent_lease=2.0)
    try:
        with colocar.connect(pool=pool.pool_file, token_file=pool.token_file("ann")):
            pass
        assert all(_tenant_sidecars(nodes, i) for i in range(2))
        os.kill(pool.record["pid"], signal.SIGKILL)
        for i in range(2):
            wait_for(lambda i=i: not _tenant_sidecars(nodes, i), f"node {i} to stop the orphaned tenant")
        wait_for(lambda: not [f for f in os.listdir(node_shm) if f.endswith(".arena")], "the arenas to go")
        os.unlink(pool.pool_file)
    finally:
        try:
            pool.down()
        finally:
            nodes.down()


def test_a_wrong_node_token_is_refused_and_starts_nothing(tmp_path, node_shm):
    nodes = LiveNodes(str(tmp_path / "nodes"), node_shm, 1).up()
    try:
        with grpc.insecure_channel(nodes.addresses) as channel:
            stub = pb_grpc.PoolNodeStub(channel)
            for metadata in ((), ((TOKEN_METADATA_KEY, "not-the-node-token"),)):
                with pytest.raises(grpc.RpcError) as refused:
                    stub.StartTenant(pb.NodeTenant(name="eve", token="t", arena=1 << 20), metadata=metadata)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert _tenant_sidecars(nodes, 0) == []
        # An agent given the wrong node token: the job is told which node refused, and why.
        wrong = str(tmp_path / "wrong.token")
        from colocar.protocol.tokens import new_token, write_token_file

        write_token_file(wrong, new_token())
        pool = LivePool(
            str(tmp_path / "pool"), node_shm, TENANTS, nodes=nodes.addresses, node_token_file=wrong
        )
        pool.up()
        try:
            with pytest.raises(ColocarError, match="UNAUTHENTICATED"):
                colocar.connect(pool=pool.pool_file, token_file=pool.token_file("ann"))
            assert _tenant_sidecars(nodes, 0) == [] and not pool.status()["tenants"]["ann"]["served"]
        finally:
            pool.down()
    finally:
        nodes.down()
