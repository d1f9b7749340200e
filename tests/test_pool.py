"""A shared pool (`colocar pool up`): tenants on sidecars of their own, refused everywhere with
another tenant's valid token (the refused attempt changes nothing), with quotas that fail
clearly, and a `pool down` that leaves nothing. Real agent and sidecar processes on loopback;
the admission queue and the tenants file's reload are in test_pool_queue.py.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import grpc
import psutil
import pytest
from helpers import wait_for
from pool_helpers import LivePool, MiB
from security_helpers import connect_request, token_metadata

import colocar
from colocar.errors import AuthError, ColocarError, QuotaExceededError
from colocar.protocol import colocar_pb2 as pb
from colocar.protocol import colocar_pb2_grpc as pb_grpc
from colocar.protocol import link

DEADLINE = 30.0
TENANTS = {
    "alice": {"quotas": {"arena": "16M", "calls": 2, "processes": 1, "sessions": 2}},
    "bob": {"quotas": {"arena": "16M", "calls": 4, "processes": 0, "sessions": 1}},
}


@pytest.fixture(scope="module")
def pool(tmp_path_factory, shm_dir):
    live = LivePool(str(tmp_path_factory.mktemp("pool")), shm_dir, TENANTS, metrics_port=0).up()
    try:
        yield live
    finally:
        live.down()


def _join(pool: LivePool, tenant: str, **kwargs) -> colocar.Cluster:
    return colocar.connect(pool=pool.pool_file, token_file=pool.token_file(tenant), **kwargs)


@colocar.colocated
def where() -> tuple[int, list[str], str]:
    import sys

    return os.getpid(), list(sys.path), os.getcwd()


@colocar.colocated(processes=True)
def worker_pid() -> int:
    time.sleep(0.2)
    return os.getpid()


def test_each_tenant_runs_in_sidecars_of_its_own(pool, tmp_path):
    with _join(pool, "alice") as alice, _join(pool, "bob") as bob:
        mine, theirs = where.on(alice.hosts)(), where.on(bob.hosts)()
        assert {pid for pid, _, _ in mine}.isdisjoint(pid for pid, _, _ in theirs)
        assert alice.stats()["pool"]["tenant"] == "alice" and bob.stats()["pool"]["tenant"] == "bob"
        stats = [h.stats() for h in alice.hosts]
        assert [s["tenant"] for s in stats] == ["alice", "alice"]
        in_workers = {worker_pid.on(alice.hosts[0]).submit() for _ in range(3)}
        pids = {f.result(DEADLINE) for f in in_workers}
        assert len(pids) == 1 and mine[0][0] not in pids  # its processes quota: one worker
        assert alice.hosts[0].stats()["worker_processes"] == 1
        moved = str(tmp_path)

        @colocar.colocated
        def wander(path: str) -> None:
            import sys

            sys.path.insert(0, path)
            os.chdir(path)

        wander.on(alice.hosts[0])(moved)  # alice's changes stay in alice's sidecar
        assert where.on(alice.hosts[0])()[1][0] == moved and where.on(alice.hosts[0])()[2] == moved
        _, path, cwd = where.on(bob.hosts[0])()
        assert moved not in path and cwd != moved


def _stub(address: str) -> tuple[grpc.Channel, pb_grpc.SidecarStub]:
    channel = grpc.insecure_channel(address)
    return channel, pb_grpc.SidecarStub(channel)


def test_another_tenants_valid_token_is_refused_everywhere_and_changes_nothing(pool):
    bob_token = pool.token("bob")
    with _join(pool, "alice") as alice, _join(pool, "bob"):
        host = alice.hosts[0]
        counter = colocar.colocated_class(_Counter).on(host)(5)
        block = host.connection.blocks.allocate([4096])[0]
        before = host.stats()
        session_id = alice.session
        channel, stub = _stub(host.address)
        with channel:
            sid, ids = session_id, [block.id, 1, 2, 3]
            attempts = {
                "Connect": connect_request(sid),
                "ListSessions": pb.Empty(),
                "CloseSession": pb.SessionSelector(selector=sid[:8]),
                "Stats": pb.Empty(),
                "Call": pb.CallRequest(session_id=sid),
                "FindObject": pb.ObjectRef(session_id=sid, object_name="c"),
                "DeleteObject": pb.ObjectRef(session_id=sid),
                "Release": pb.ReleaseRequest(session_id=sid, block_ids=ids),
                "Download": pb.BlockRef(session_id=sid, block_id=block.id),
                "Disconnect": pb.SessionRef(session_id=sid),
            }
            for method, request in attempts.items():
                with pytest.raises(grpc.RpcError) as refused:
                    reply = getattr(stub, method)(request, metadata=token_metadata(bob_token))
                    list(reply) if method == "Download" else reply
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, method
        _link_refuses(host, bob_token)
        with pytest.raises(AuthError):  # and through colocar itself
            colocar.connect([host.address], token=bob_token)
        after = host.stats()
        assert (after["sessions"], after["objects"], after["pools"]) == (
            before["sessions"],
            before["objects"],
            before["pools"],
        )
        assert counter.add(1) == 6  # alice's object, her session and her blocks are untouched
        host.connection.blocks.release([block])


class _Counter:
    def __init__(self, n: int):
        self.n = n

    def add(self, k: int) -> int:
        self.n += k
        return self.n


def _link_refuses(host, token: str) -> None:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(DEADLINE)
        sock.connect(host.connection.session.info.link_path)
        link.send_request(sock, link.HELLO, token.encode())
        status, _ = link.parse_reply(link.recv_frame(sock))
        assert status == grpc.StatusCode.UNAUTHENTICATED.value[0]


def test_the_pool_shows_a_tenant_its_own_entry_only_and_stops_only_for_the_admin(pool):
    from colocar.controller_bridge import pool_client as client

    seen = pool.status("bob")
    assert set(seen["tenants"]) == {"bob"} and "queue_waits" not in seen
    assert set(pool.status()["tenants"]) == {"alice", "bob"}
    with pytest.raises(AuthError):
        client.shutdown(pool.pool_file, pool.token("bob"))
    with pytest.raises(AuthError):
        client.pool_status(pool.pool_file, "not-a-token")
    with pytest.raises(ColocarError, match="the admin token is no tenant's"):
        client.admit(pool.pool_file, pool.admin_token())
    assert pool.status()["hosts"] == 2  # still up


def test_one_tenants_burst_cannot_take_anothers_arena(pool):
    with _join(pool, "alice") as alice, _join(pool, "bob") as bob:
        alice_blocks = alice.hosts[0].connection.blocks
        taken = alice_blocks.allocate([15 * MiB])  # all alice's arena, and more is refused
        with pytest.raises(QuotaExceededError, match="tenant 'alice': arena quota reached"):
            alice_blocks.allocate([2 * MiB], timeout=0.5)
        mine = bob.hosts[0].connection.blocks.allocate([15 * MiB], timeout=0.5)  # bob's share is whole
        bob.hosts[0].connection.blocks.release(mine)
        alice_blocks.release(taken)


def test_quotas_refuse_clearly_naming_the_quota_and_the_use(pool):
    with _join(pool, "bob", session="first") as bob:
        with pytest.raises(
            QuotaExceededError, match=r"tenant 'bob': sessions quota reached \(1; in use: 1: first\)"
        ):
            _join(pool, "bob")
        with pytest.raises(QuotaExceededError, match=r"tenant 'bob': arena quota reached"):
            bob.hosts[0].connection.blocks.allocate([32 * MiB], timeout=1.0)
        assert where.on(bob.hosts[0])()[0] > 0  # still served
    with _join(pool, "alice") as alice:
        flag = os.path.join(pool.folder, "release")

        @colocar.colocated
        def hold(path: str) -> int:
            deadline = time.monotonic() + DEADLINE
            while not os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.02)
            return 1

        results: list[int] = []  # calls of one thread keep its order: two threads, two calls at once
        threads = [
            threading.Thread(target=lambda: results.append(hold.on(alice.hosts[0])(flag))) for _ in range(2)
        ]
        for t in threads:
            t.start()
        wait_for(lambda: alice.hosts[0].stats()["in_flight"] >= 2, "alice's two calls to run")
        quota = r"tenant 'alice': concurrent calls quota reached \(2; in use: 2 running\)"
        with pytest.raises(QuotaExceededError, match=quota):
            where.on(alice.hosts[0])()
        open(flag, "w").close()
        for t in threads:
            t.join(DEADLINE)
        assert results == [1, 1]
        assert where.on(alice.hosts[0])()[0] > 0  # the slots came back
        refusals = alice.hosts[0].stats()["quota_refusals"]
        assert refusals["concurrent calls"] >= 1


def _scrape(pool: LivePool) -> dict[tuple[str, ...], float]:
    """The agent's metrics: (name, its tenant label, its quota label, where it has them) -> value."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{pool.record['metrics']}/metrics", timeout=DEADLINE) as reply:
        text = reply.read().decode()
    return {
        (sample.name, *(sample.labels[k] for k in ("tenant", "quota") if k in sample.labels)): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_the_agent_exports_each_tenants_calls_bytes_use_refusals_and_queue_wait(pool):
    refused = ("colocar_pool_tenant_quota_refusals_total", "bob", "sessions")
    moved = ("colocar_pool_tenant_arena_allocated_bytes_total", "bob")
    with _join(pool, "bob", session="metered") as bob:
        before = _scrape(pool)
        for _ in range(3):
            where.on(bob.hosts[0])()
        blocks = bob.hosts[1].connection.blocks
        blocks.release(blocks.allocate([3 * MiB]))  # 3 MiB through bob's arena on host 1
        with pytest.raises(QuotaExceededError):
            _join(pool, "bob")

        def seen() -> dict:  # the agent looks at its tenants' sidecars every second
            found = _scrape(pool)
            sessions = found.get(("colocar_pool_tenant_sessions", "bob"))
            grew = found.get(moved, 0) >= before.get(moved, 0) + 3 * MiB
            return found if found.get(refused, 0) > before.get(refused, 0) and sessions == 2 and grew else {}

        found = wait_for(seen, "bob's session and refusal in the metrics")
        assert found[("colocar_pool_tenant_served", "bob")] == 1
        assert found[("colocar_pool_tenant_calls_total", "bob")] >= 3
        assert found[("colocar_pool_tenant_quota", "alice", "arena")] == 16 * MiB
        assert found[("colocar_pool_tenant_arena_used_bytes", "bob")] >= 0
        assert found[("colocar_pool_queue_wait_seconds_count", "bob")] >= 1
        assert found[("colocar_pool_queue_waiting",)] == 0


def test_pool_down_leaves_no_process_and_no_arena(tmp_path, shm_dir):
    live = LivePool(str(tmp_path), shm_dir, {"erin": {"quotas": {"arena": "8M"}}}).up()
    try:
        with colocar.connect(pool=live.pool_file, token_file=live.token_file("erin")) as erin:
            assert where.on(erin.hosts)()
        agent = psutil.Process(live.record["pid"])
        sidecars = [p for p in agent.children(recursive=True) if "colocar.sidecar" in " ".join(p.cmdline())]
        assert len(sidecars) == 2
        assert [f for f in os.listdir(shm_dir) if "erin" in f], os.listdir(shm_dir)
    finally:
        live.down()
    assert not agent.is_running() or agent.status() == psutil.STATUS_ZOMBIE
    left = [p for p in sidecars if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [(p.pid, p.status(), p.cmdline()) for p in left]
    assert not [f for f in os.listdir(shm_dir) if "erin" in f]
    assert not os.path.exists(live.pool_file)
