"""Round trip of a trivial colocated call, against a bare gRPC echo and a raw TCP ping-pong.

The three are measured interleaved (one batch of each per round, the order rotating), so drift
on a noisy machine hits all of them alike; each figure is the median over rounds of that
round's percentile. The peers run in separate processes, like the sidecar:

* `grpc_echo`: a synchronous `grpc.server(ThreadPoolExecutor)` with one unary method whose
  handler returns the request; no (de)serializers on either side (bytes in, bytes out).
* `socket`: a TCP ping-pong (TCP_NODELAY) of a small message; the floor for any loopback RPC.

Goals (issue 34): a call's p50 within 4x the socket's (`socket_ratio`, `p50_us` /
`socket_p50_us`, against `socket_ratio_goal`) and `submit().result()` within 6x
(`future_socket_ratio`, `future_p50_us` / `socket_p50_us`, against `future_socket_ratio_goal`);
`socket_goal_met` and `future_socket_goal_met` say whether this run met them.
`future_timeout_p50_us` is `submit().result(timeout=60)`: a wait with a limit (no goal; it
shows what a bounded wait costs over `future_p50_us`).

An array call, apart (4 local sidecars, 2 of 8 CPU devices each): `array_call_p50_us` is
`f(x) = x + 1` of a small f32[64, 64] sharded by rows over the 8 devices (planning, each
host's block, the 4 calls, the global result), against `hosts_calls_p50_us`, the same blocks
as numpy arrays sent with `f.on(host).submit` to each host and waited for (what a user would
write by hand, without a global array); `array_call_ratio` is the first over the second.

`python -m colocar.bench.rpc grpc-server|socket-server` runs a peer (it prints its port).
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

from colocar.bench import child_env

PAYLOAD = b"x" * 64
SOCKET_RATIO_GOAL = 4.0  # a call's p50 over the socket ping-pong's
FUTURE_SOCKET_RATIO_GOAL = 6.0  # submit().result()'s p50 over the socket ping-pong's
METHOD = "/colocar.bench.Echo/Echo"


# --- peers (run in their own processes) ----------------------------------------------------
def _serve_grpc() -> None:
    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("colocar.bench.Echo", {"Echo": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    sys.stdin.read()  # until the parent closes our stdin (or dies)
    server.stop(0)


def _serve_socket() -> None:
    import threading

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    print(listener.getsockname()[1], flush=True)

    def serve() -> None:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            data = conn.recv(65536)
            if not data:
                return
            conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    sys.stdin.read()


class Peer:
    """A peer process started with `python -m colocar.bench.rpc KIND`; stops when closed."""

    def __init__(self, kind: str):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "colocar.bench.rpc", kind],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=child_env(),
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line.strip():
            self.close()
            raise RuntimeError(f"benchmark peer {kind} did not start")
        self.port = int(line)

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


# --- clients -------------------------------------------------------------------------------
def _timed(call: Callable[[], Any], n: int) -> list[float]:
    """Per-call latencies in microseconds."""
    clock = time.perf_counter_ns
    out = []
    for _ in range(n):
        t0 = clock()
        call()
        out.append((clock() - t0) / 1000.0)
    return out


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _socket_client(port: int) -> tuple[Callable[[], Any], Callable[[], None]]:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    n = len(PAYLOAD)

    def ping() -> None:
        sock.sendall(PAYLOAD)
        got = 0
        while got < n:
            got += len(sock.recv(n - got))

    return ping, sock.close


def _grpc_client(port: int) -> tuple[Callable[[], Any], Callable[[], None]]:
    import grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=30)
    echo = channel.unary_unary(METHOD)  # no serializers: bytes in, bytes out

    def ping() -> bytes:
        return echo(PAYLOAD)

    return ping, channel.close


def noop() -> None:
    return None


def plus_one(x: Any) -> Any:
    return x + 1


ARRAY_HOSTS = 4
ARRAY_DEVICES = 8  # CPU devices of this process: 2 per host
ARRAY_SHAPE = (64, 64)


def _array_clients(cluster: Any) -> dict[str, Callable[[], Any]]:
    """An array call over every host, and the hand-written calls of the same blocks."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import colocar

    add_one = colocar.colocated(plus_one)
    x = jax.device_put(np.ones(ARRAY_SHAPE, np.float32), NamedSharding(cluster.mesh(("data",)), P("data")))
    rows = ARRAY_SHAPE[0] // len(cluster.hosts)
    blocks = [np.ones((rows, ARRAY_SHAPE[1]), np.float32) for _ in cluster.hosts]
    per_host = [add_one.on(h) for h in cluster.hosts]

    def hosts_calls() -> list[Any]:
        futures = [call.submit(block) for call, block in zip(per_host, blocks, strict=True)]
        return [future.result() for future in futures]

    return {"array_call": lambda: add_one(x), "hosts_calls": hosts_calls}


def _interleaved(
    clients: dict[str, Callable[[], Any]], rounds: int, calls: int
) -> dict[str, list[tuple[float, float]]]:
    """Per client, the (p50, p99) latency of each round's batch of `calls`; the clients take
    turns within a round, the order rotating from round to round."""
    names = list(clients)
    per_round: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            latencies = _timed(clients[name], calls)
            per_round[name].append((_percentile(latencies, 0.5), _percentile(latencies, 0.99)))
    return per_round


def _summary(
    quick: bool, rounds: int, calls: int, per_round: dict[str, list[tuple[float, float]]], stats: dict
) -> dict[str, Any]:
    """The result: medians over rounds of each client's percentiles, and the ratios to gRPC."""

    def median(name: str, i: int) -> float:
        return round(statistics.median(p[i] for p in per_round[name]), 1)

    result: dict[str, Any] = {
        "benchmark": "rpc",
        "quick": quick,
        "rounds": rounds,
        "calls_per_round": calls,
        "p50_us": median("colocar", 0),
        "p99_us": median("colocar", 1),
        "future_p50_us": median("colocar_future", 0),
        "future_p99_us": median("colocar_future", 1),
        "future_timeout_p50_us": median("colocar_future_timeout", 0),
        "grpc_path_p50_us": median("colocar_grpc", 0),
        "grpc_path_p99_us": median("colocar_grpc", 1),
        "grpc_echo_p50_us": median("grpc_echo", 0),
        "grpc_echo_p99_us": median("grpc_echo", 1),
        "socket_p50_us": median("socket", 0),
        "socket_p99_us": median("socket", 1),
        "sidecar_handler_p50_us": round(float(stats.get("latency_p50_us", 0.0)), 1),
    }
    result["ratio"] = round(result["p50_us"] / result["grpc_echo_p50_us"], 3)
    result["grpc_path_ratio"] = round(result["grpc_path_p50_us"] / result["grpc_echo_p50_us"], 3)
    for name, key, goal in (
        ("socket", "p50_us", SOCKET_RATIO_GOAL),
        ("future_socket", "future_p50_us", FUTURE_SOCKET_RATIO_GOAL),
    ):
        result[f"{name}_ratio"] = round(result[key] / result["socket_p50_us"], 2)
        result[f"{name}_ratio_goal"] = goal
        result[f"{name}_goal_met"] = result[f"{name}_ratio"] <= goal
    if "array_call" in per_round:
        result["array_call_p50_us"] = median("array_call", 0)
        result["array_call_p99_us"] = median("array_call", 1)
        result["hosts_calls_p50_us"] = median("hosts_calls", 0)
        result["array_call_ratio"] = round(result["array_call_p50_us"] / result["hosts_calls_p50_us"], 2)
    result["p50_us_per_round"] = [round(p[0], 1) for p in per_round["colocar"]]
    result["grpc_echo_p50_us_per_round"] = [round(p[0], 1) for p in per_round["grpc_echo"]]
    return result


def run(quick: bool, repeats: int) -> dict:
    """Starts the two peers and one local sidecar, then times the six clients interleaved;
    then 4 local sidecars, and the array call against the hand-written calls, interleaved."""
    from colocar.bench import request_cpu_devices

    request_cpu_devices(ARRAY_DEVICES)  # before JAX starts its backends
    import colocar

    rounds = max(3, repeats)
    calls = 200 if quick else 1000
    warmup = 100 if quick else 300
    remote_noop = colocar.colocated(noop)
    peers: list[Peer] = []
    closers: list[Callable[[], None]] = []
    try:
        peers = [Peer("grpc-server"), Peer("socket-server")]
        grpc_ping, close = _grpc_client(peers[0].port)
        closers.append(close)
        socket_ping, close = _socket_client(peers[1].port)
        closers.append(close)
        with colocar.local_cluster(hosts=1, processes=0) as cluster:
            host = cluster.hosts[0]
            colocar_call = remote_noop.on(host)
            assert host.connection.transport.link is not None, "expected the local link on the same host"
            token = open(cluster.token_file).read()  # type: ignore[attr-defined]
            remote = colocar.connect([host.address], token=token, shm=False)  # as from another host
            grpc_call = remote_noop.on(remote.hosts[0])
            clients = {
                "colocar": colocar_call,  # sync call, same host: the local link
                "colocar_future": lambda: colocar_call.submit().result(),  # a future, same host
                "colocar_future_timeout": lambda: colocar_call.submit().result(timeout=60),
                "colocar_grpc": grpc_call,  # sync call without shared memory: gRPC
                "grpc_echo": grpc_ping,
                "socket": socket_ping,
            }
            for call in clients.values():
                _timed(call, warmup)
            per_round = _interleaved(clients, rounds, calls)
            stats = host.stats()
            remote.close()
        with colocar.local_cluster(hosts=ARRAY_HOSTS, processes=0) as cluster:
            arrays = _array_clients(cluster)
            for call in arrays.values():
                _timed(call, warmup // 4)
            per_round.update(_interleaved(arrays, rounds, calls // 4))
    finally:
        for close in closers:
            close()
        for peer in peers:
            peer.close()
    return _summary(quick, rounds, calls, per_round, stats)


if __name__ == "__main__":
    kind = sys.argv[1] if len(sys.argv) > 1 else ""
    if kind == "grpc-server":
        _serve_grpc()
    elif kind == "socket-server":
        _serve_socket()
    else:
        print("usage: python -m colocar.bench.rpc {grpc-server,socket-server}  (`colocar bench rpc` peers)")
        sys.exit(2)
