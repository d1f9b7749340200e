"""Hostile or careless input costs bounded memory and time (real sidecars, real sockets).

A stranger's large gRPC messages are refused from their metadata, before they are read; idle
strangers on the local link neither exhaust the sidecar nor keep a controller's connections
out; a request too large for a message, or an allocation that can never fit its pool, fails at
once with an error that says so.
"""

from __future__ import annotations

import resource
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import psutil
import pytest
from security_helpers import DEADLINE, RPC_TIMEOUT, assert_serving, token_metadata

import colocar
from colocar.errors import ColocarError
from colocar.protocol import colocar_pb2 as pb
from colocar.protocol import colocar_pb2_grpc as pb_grpc
from colocar.protocol import link
from colocar.sidecar import link_server

MiB = 1 << 20
STRANGERS = 16  # concurrent messages without the token
STRANGER_BYTES = 48 * MiB  # each: read in full before, that was 16 * 48 MiB of sidecar memory
RSS_BOUND = 192 * MiB  # generous: refused unread, they cost the sidecar a few MiB


def _peak_rss(pid: int, stop: threading.Event, peak: list[int]) -> None:
    process = psutil.Process(pid)
    while not stop.is_set():
        peak[0] = max(peak[0], process.memory_info().rss)
        stop.wait(0.02)


def _send_unauthenticated(address: str, body: bytes) -> list[grpc.StatusCode]:
    """`STRANGERS` concurrent Calls carrying `body`, with a wrong token; their status codes."""
    options = [("grpc.max_send_message_length", -1)]
    channels = [grpc.insecure_channel(address, options=options) for _ in range(4)]
    try:

        def one(i: int) -> grpc.StatusCode:
            stub = pb_grpc.SidecarStub(channels[i % len(channels)])
            request = pb.CallRequest(session_id="stranger", name="big", code=body)
            try:
                stub.Call(request, metadata=token_metadata("wrong"), timeout=DEADLINE)
            except grpc.RpcError as e:
                return e.code()
            return grpc.StatusCode.OK

        with ThreadPoolExecutor(STRANGERS) as pool:
            return list(pool.map(one, range(STRANGERS)))
    finally:
        for channel in channels:
            channel.close()


def test_strangers_large_messages_are_refused_unread(sidecar, client):
    assert_serving(sidecar, client)  # what a first call loads is loaded before measuring
    process = psutil.Process(sidecar.process.pid)
    before = process.memory_info().rss
    peak, stop = [before], threading.Event()
    watcher = threading.Thread(target=_peak_rss, args=(sidecar.process.pid, stop, peak), daemon=True)
    watcher.start()
    try:
        codes = _send_unauthenticated(sidecar.address, b"x" * STRANGER_BYTES)
    finally:
        stop.set()
        watcher.join()
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * STRANGERS
    after = process.memory_info().rss
    assert peak[0] - before < RSS_BOUND, f"peak RSS grew {(peak[0] - before) / MiB:.0f} MiB"
    assert after - before < RSS_BOUND, f"RSS grew {(after - before) / MiB:.0f} MiB and stayed"
    assert_serving(sidecar, client)


def test_a_request_too_large_for_a_message_fails_clearly(cluster, grpc_cluster):
    table = np.ones(link.MAX_REQUEST + MiB, np.uint8)  # captured: travels inside the code

    def total() -> int:
        return int(table.sum())

    def totals() -> Iterator[int]:
        yield int(table.sum())

    for c in (cluster, grpc_cluster):
        with pytest.raises(ColocarError, match="pass large values as arguments"):
            colocar.colocated(total).on(c.hosts[0])()
        future = colocar.colocated(total).on(c.hosts[0]).submit()  # the same, started asynchronously
        with pytest.raises(ColocarError, match="pass large values as arguments"):
            future.result(timeout=DEADLINE)
        with pytest.raises(ColocarError, match="pass large values as arguments"):  # a stream's call
            list(colocar.colocated(totals).on(c.hosts[0])())
        assert c.hosts[0].connection.session.lost is None
        assert colocar.colocated(lambda t: int(t.sum())).on(c.hosts[0])(table) == table.size  # as an argument


def test_a_too_large_message_from_a_token_holder_is_refused(sidecar, stub):
    request = pb.CallRequest(session_id="any", name="big", code=b"x" * (link.MAX_REQUEST + 1))
    with pytest.raises(grpc.RpcError) as info:
        stub.Call(request, metadata=token_metadata(sidecar.token), timeout=RPC_TIMEOUT)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


# --- the local link ----------------------------------------------------------------------------
def _idle_connections(path: str, count: int) -> list[socket.socket]:
    """`count` connections that never say hello (each retried while the listen backlog is full)."""
    sockets: list[socket.socket] = []
    deadline = time.monotonic() + DEADLINE
    try:
        while len(sockets) < count:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.connect(path)
            except BlockingIOError:
                sock.close()
                assert time.monotonic() < deadline, f"only {len(sockets)} connections accepted"
                time.sleep(0.001)
                continue
            sockets.append(sock)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def test_idle_strangers_on_the_link_do_not_keep_the_controller_out(make_cluster):
    # A long lease: a sidecar busy closing a thousand connections on 2 loaded cores may miss
    # keepalives for seconds; the test is about calls getting through, not about the lease.
    c = make_cluster(heartbeat_seconds=0.5, lease_seconds=30, processes=0)
    host = c.hosts[0]
    path = host.connection.session.info.link_path
    assert host.connection.transport.link is not None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    count = min(1100, soft - 200)  # the sidecar inherits this limit too
    assert count > link_server.MAX_UNPROVEN * 4, f"the fd limit ({soft}) is too low for this test"
    idle = _idle_connections(path, count)
    try:
        # New controller threads open new link connections; each call must get through.
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(colocar.colocated(lambda i: i * 2).on(host), range(32)))
        assert results == [i * 2 for i in range(32)]
        time.sleep(4 * 0.5)  # heartbeats go on over the link meanwhile
        assert host.connection.session.lost is None, host.connection.session.lost
        threads = psutil.Process(c.processes[0].pid).num_threads()
        assert threads < count // 2, f"{threads} sidecar threads for {count} idle connections"
        # A stranger that never says hello is closed within the handshake time (or as the oldest).
        idle[-1].setblocking(True)
        idle[-1].settimeout(link_server.HELLO_SECONDS + DEADLINE)
        assert idle[-1].recv(1) == b""
    finally:
        for sock in idle:
            sock.close()
    assert colocar.colocated(lambda: 7).on(host)() == 7


def test_a_stranger_cannot_make_the_link_read_a_large_hello(cluster):
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(DEADLINE)
        sock.connect(cluster.hosts[0].connection.session.info.link_path)
        sock.sendall(link.LENGTH.pack(link.MAX_HELLO + 1))  # closed before a byte of it is read
        assert sock.recv(1) == b""
    assert colocar.colocated(lambda: 3).on(cluster.hosts[0])() == 3


# --- allocations that can never fit ------------------------------------------------------------
def test_an_allocation_that_can_never_fit_fails_at_once(make_cluster):
    c = make_cluster(alloc_timeout=600.0, processes=0)  # a regression would wait 10 minutes

    @colocar.colocated
    def read_more_than_the_arena(n: int) -> int:
        import numpy as np

        from colocar import shm

        held = [shm.empty((n,), np.uint8) for _ in range(64)]  # as a restore reads its slices
        return len(held)

    future = read_more_than_the_arena.on(c.hosts[0]).submit(4 * MiB)  # 16 MiB arena
    with pytest.raises(Exception, match="no wait helps"):
        future.result(timeout=DEADLINE / 2)
    assert read_more_than_the_arena.on(c.hosts[0])(128 * 1024) == 64  # fits: still served


def test_a_multi_block_request_larger_than_the_pool_fails_at_once(sidecar, stub, session):
    sizes = [6 * MiB, 6 * MiB, 6 * MiB]  # each fits the 16 MiB arena, all three never do
    request = pb.AllocateRequest(session_id=session, sizes=sizes, timeout_seconds=600.0)
    with pytest.raises(grpc.RpcError) as info:
        stub.Allocate(request, metadata=token_metadata(sidecar.token), timeout=DEADLINE / 2)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    assert "no wait helps" in info.value.details()


def test_the_allocator_refuses_what_can_never_fit_and_keeps_nothing():
    from colocar.shm import Allocator, ArenaFullError

    allocator = Allocator(4096, 8 * MiB)
    held = allocator.allocate(MiB, owner="other")  # someone else's block: worth waiting for
    with pytest.raises(ArenaFullError, match="no wait helps"):
        allocator.allocate_all([3 * MiB, 3 * MiB, 3 * MiB], owner="s", timeout=600.0)
    with pytest.raises(ArenaFullError, match="no wait helps"):
        allocator.allocate(5 * MiB, owner="s", timeout=600.0, pinned=4 * MiB)
    assert allocator.stats()["default"]["used"] == MiB, "a refused request keeps no block"
    blocks = allocator.allocate_all([3 * MiB, 3 * MiB], owner="s", timeout=600.0)
    assert len(blocks) == 2
    allocator.release(held.id, "other")
    allocator.release_owner("s")
    assert allocator.stats()["default"]["used"] == 0


def test_a_restore_larger_than_the_arena_fails_at_once(make_cluster, tmp_path):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from colocar.checkpoint import CheckpointError, CheckpointManager

    url = str(tmp_path / "ckpt")
    big = make_cluster(arena_size=64 * MiB, processes=0)
    sharding = NamedSharding(big.mesh(("data",), (8,)), P("data"))
    state = {f"w{i}": jax.device_put(np.full((1024, 1024), i, np.float32), sharding) for i in range(6)}
    with CheckpointManager(url, big) as mngr:  # 24 MiB
        mngr.save(1, state)
        mngr.wait()
    big.close()
    small = make_cluster(arena_size=16 * MiB, processes=0, alloc_timeout=600.0)
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    mngr, pool = CheckpointManager(url, small), ThreadPoolExecutor(1)
    try:
        restoring = pool.submit(mngr.restore, 1, target)  # a regression waits 10 minutes
        with pytest.raises(CheckpointError, match="no wait helps"):
            restoring.result(timeout=DEADLINE / 2)
    finally:
        pool.shutdown(wait=False)
        small.close()  # ends a restore still waiting (a regression) before the manager closes
        mngr.close()
