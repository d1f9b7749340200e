"""A shared pool's admission queue (priorities, positions, estimates, giving up), its tenants
file re-read while it runs (a tenant added, a token rotated, one removed, a broken file), and
a killed job whose blocks and objects the pool frees without a restart. Real agent and
sidecar processes, real controllers joining with `colocar.connect(pool=...)`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers import program, wait_for
from pool_helpers import LivePool

import colocar
from colocar.errors import AuthError, PoolFullError
from colocar.pool.tenant_sidecars import sidecar_stats

DEADLINE = 60.0
ONE_AT_A_TIME = {  # each needs the whole pool's 16 MiB per host: one tenant is served at a time
    "a": {"quotas": {"arena": "16M"}},
    "b": {"quotas": {"arena": "16M"}},
    "vip": {"priority": 10, "quotas": {"arena": "16M"}},
}


def _join(pool: LivePool, tenant: str, **kwargs) -> colocar.Cluster:
    return colocar.connect(pool=pool.pool_file, token_file=pool.token_file(tenant), **kwargs)


def _queued(pool: LivePool) -> list[str]:
    return [w["tenant"] for w in pool.status()["queue"]]


def test_a_full_pool_queues_by_priority_shows_positions_and_gives_up_cleanly(tmp_path, shm_dir, capfd):
    pool = LivePool(str(tmp_path), shm_dir, ONE_AT_A_TIME, capacity="16M", idle_seconds=1.0).up()
    try:
        a = _join(pool, "a")
        with pytest.raises(PoolFullError, match=r"pool is full for tenant 'b'.*position 1 of 1; not waiting"):
            _join(pool, "b", wait=False)
        with pytest.raises(PoolFullError, match=r"waited \d+ s \(its timeout\)"):
            _join(pool, "b", queue_timeout=1.0)
        assert _queued(pool) == []  # the tickets given up left the queue
        _ctrl_c_leaves_the_queue(pool)
        joined: dict[str, colocar.Cluster] = {}
        threads = {
            name: threading.Thread(target=lambda n=name: joined.update({n: _join(pool, n)}))
            for name in ("b", "vip")
        }
        threads["b"].start()
        wait_for(lambda: _queued(pool) == ["b"], "b in the queue")
        threads["vip"].start()
        wait_for(lambda: _queued(pool) == ["vip", "b"], "vip ahead of b (its priority)")
        a.close()  # a's sidecars go idle and stop: vip's turn
        threads["vip"].join(DEADLINE)
        assert "vip" in joined and "b" not in joined and _queued(pool) == ["b"]
        assert colocar.colocated(lambda: 5).on(joined["vip"].hosts)() == [5, 5]
        joined["vip"].close()
        threads["b"].join(DEADLINE)
        b = joined["b"]
        seen = b.stats()["pool"]
        assert seen["tenant"] == "b" and seen["queued"] and seen["waited_seconds"] > 0
        positions = [u["position"] for u in seen["updates"]]
        assert positions[0] == 1 and 2 in positions and positions[-1] == 1, positions  # vip came in ahead
        assert seen["updates"][-1]["estimate"] >= 0  # tenants have left by then: an estimate
        b.close()
        err = capfd.readouterr().err
        assert "the pool is full; waiting in its queue: position 2 of 2" in err
        assert "estimated wait unknown yet" in err and "estimated wait about" in err
        waits = pool.status()["queue_waits"]
        assert [w[0] for w in waits] == ["a", "vip", "b"]
    finally:
        pool.down()


def _ctrl_c_leaves_the_queue(pool: LivePool) -> None:
    """`colocar pool admit` waiting in the queue, then Ctrl-C as a terminal sends it (SIGINT
    to its whole process group): it ends, and its ticket leaves the queue."""
    waiting = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "colocar",
            "pool",
            "admit",
            "--pool",
            pool.pool_file,
            "--token-file",
            pool.token_file("b"),
        ],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for(lambda: _queued(pool) == ["b"], "the command in the queue")
        os.killpg(waiting.pid, signal.SIGINT)
        assert waiting.wait(DEADLINE) == 130, waiting.stderr.read()
        assert "interrupted" in waiting.stderr.read()
        wait_for(lambda: _queued(pool) == [], "its ticket to leave the queue")
    finally:
        waiting.kill()
        waiting.wait()


def test_the_tenants_file_is_reread_while_the_pool_runs(tmp_path, shm_dir):
    tenants = {"carol": {"quotas": {"arena": "8M", "sessions": 2}}, "dan": {"quotas": {"arena": "8M"}}}
    pool = LivePool(str(tmp_path), shm_dir, tenants).up()
    try:
        with _join(pool, "carol") as carol, _join(pool, "dan"):
            assert colocar.colocated(lambda: 1).on(carol.hosts[0])() == 1
            new_token = pool.rotate("carol")
            # The new token works at once, on every host (the agent and the sidecars re-read
            # a changed file before refusing a token they do not know) ...
            with colocar.connect(pool=pool.pool_file, token=new_token) as again:
                assert [colocar.colocated(lambda: 2).on(h)() for h in again.hosts] == [2, 2]

            def refused() -> bool:
                try:
                    colocar.colocated(lambda: 1).on(carol.hosts[0])()
                except AuthError:
                    return True
                return False

            wait_for(refused, "carol's old token to be refused")  # ... the old one within a second or so
            pool.entries["erin"] = {"token_file": "erin.token", "quotas": {"arena": "8M"}}
            from colocar.protocol.tokens import new_token as make_token
            from colocar.protocol.tokens import write_token_file

            write_token_file(pool.token_file("erin"), make_token())
            del pool.entries["dan"]
            pool.write_tenants()
            wait_for(lambda: set(pool.status()["tenants"]) == {"carol", "erin"}, "the file to be re-read")
            with _join(pool, "erin") as erin:  # added: served at once
                assert colocar.colocated(lambda: 3).on(erin.hosts[0])() == 3
            wait_for(lambda: "dan" not in _served(pool), "dan's sidecars to stop (removed)")
            with pytest.raises(AuthError):
                _join(pool, "dan")
            with open(pool.tenants_file, "w") as f:
                f.write("tenants: [not, a, mapping")
            wait_for(lambda: pool.status()["tenants_file_error"], "the broken file to be reported")
            assert set(pool.status()["tenants"]) == {"carol", "erin"}  # the last good one stays
    finally:
        pool.down()


def _served(pool: LivePool) -> list[str]:
    return [name for name, t in pool.status()["tenants"].items() if t["served"]]


def _killed_job(pool: LivePool, tenant: str, *session: str) -> None:
    """tests/programs/pool_job.py as `tenant`, holding blocks and an object, then SIGKILLed."""
    job = subprocess.Popen(
        [sys.executable, program("pool_job"), pool.pool_file, pool.token_file(tenant), *session],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = job.stdout.readline()
        assert line.startswith("READY") and int(line.split()[1]) >= 4 << 20, line
    finally:
        job.kill()
        job.wait()


def test_a_killed_job_frees_what_it_held_without_a_pool_restart(tmp_path, shm_dir):
    pool = LivePool(str(tmp_path), shm_dir, {"fay": {"quotas": {"arena": "16M", "sessions": 1}}}).up()
    try:
        _killed_job(pool, "fay")

        addresses, token = pool.status()["tenants"]["fay"]["addresses"], pool.token("fay")

        def freed() -> bool:  # asked now: the pool's status says what its last look (each 1 s) saw
            hosts = sidecar_stats(addresses, token)
            return bool(hosts) and all(h.get("sessions") == 0 and h.get("arena_used") == 0 for h in hosts)

        wait_for(freed, "the killed job's session, blocks and object to be freed", DEADLINE)
        with _join(pool, "fay") as fay:  # its one session is free again: no restart needed
            assert colocar.colocated(lambda: 4).on(fay.hosts)() == [4, 4]
    finally:
        pool.down()


def test_a_named_session_outlives_its_job_and_a_later_job_reattaches(tmp_path, shm_dir):
    """A notebook's kernel dies: its named session detaches and waits out its grace, which
    keeps the tenant's sidecars (it is a session, however idle), and the next job under the
    name takes it over with its named object."""
    pool = LivePool(str(tmp_path), shm_dir, {"gus": {"quotas": {"arena": "16M"}}}, idle_seconds=1).up()
    try:
        _killed_job(pool, "gus", "nb")
        wait_for(lambda: _detached(pool, "gus"), "the session to detach (its lease, 3 s)")
        later = time.monotonic() + 3  # three of the pool's idle checks (every second, 1 s idle)
        wait_for(lambda: time.monotonic() > later, "the pool's idle checks")
        assert _served(pool) == ["gus"]
        with _join(pool, "gus", session="nb") as again:
            assert again.took_over
            assert again.object("box").value() == 3  # as the killed job left it
    finally:
        pool.down()


def _detached(pool: LivePool, tenant: str) -> bool:
    import grpc

    from colocar.protocol import colocar_pb2 as pb
    from colocar.protocol import colocar_pb2_grpc as pb_grpc
    from colocar.protocol.tokens import TOKEN_METADATA_KEY

    address = pool.status()["tenants"][tenant]["addresses"][0]
    with grpc.insecure_channel(address) as channel:
        reply = pb_grpc.SidecarStub(channel).ListSessions(
            pb.Empty(), metadata=((TOKEN_METADATA_KEY, pool.token(tenant)),), timeout=DEADLINE
        )
    return any(s.name == "nb" and not s.attached for s in reply.sessions)


def test_a_tenant_whose_sidecar_dies_is_stopped_and_its_next_job_gets_fresh_ones(tmp_path, shm_dir):
    import psutil

    pool = LivePool(str(tmp_path), shm_dir, {"hal": {"quotas": {"arena": "16M"}}}, capacity="16M").up()
    try:
        with _join(pool, "hal") as hal:
            first = pool.status()["tenants"]["hal"]["addresses"]
            pid = colocar.colocated(os.getpid).on(hal.hosts[1])()
        psutil.Process(pid).kill()  # host 1's sidecar of hal is lost (an OOM kill)
        wait_for(lambda: _served(pool) == [], "the pool to stop hal's other sidecar and free its room")
        with _join(pool, "hal") as again:  # its room was given back: it fits again
            assert colocar.colocated(lambda: 6).on(again.hosts)() == [6, 6]
            assert pool.status()["tenants"]["hal"]["addresses"] != first
    finally:
        pool.down()
