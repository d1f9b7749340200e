"""Fairness in a shared pool: tenant B's calls and stream while tenant A floods, against B alone.

A local pool (`colocar pool up`, one host) serves two tenants, each on its own sidecar. B, in
this process, measures a loop of trivial calls (p50, p99) and a stream of 1 MiB batches
(batches/s); A, in another process (its own controller, like another user's job), floods: 8
threads of calls that each hold A's sidecar for 2 ms of Python, and a stream of its own.
Rounds alternate B alone and B under A's flood, so drift on a noisy machine hits both alike;
figures are medians over rounds. Goals (issue 35): `throughput_ratio` (B's stream under the
flood over alone) >= 0.8 and `p99_ratio` (B's p99 under the flood over alone) <= 2.

`python -m colocar.bench.pool flood POOL_FILE TOKEN_FILE` runs A (until its stdin closes).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from colocar.bench import child_env

THROUGHPUT_GOAL, P99_GOAL = 0.8, 2.0
FLOOD_THREADS = 8
BATCH = 1 << 20


def _busy(seconds: float) -> int:
    end, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        n += 1
    return n


def _batches(count: int) -> Any:
    import numpy as np

    for i in range(count):
        yield np.full(BATCH, i % 251, np.uint8)


def _flood(pool_file: str, token_file: str) -> None:
    """Tenant A: calls and a stream from several threads, as fast as they go, until stdin ends."""
    import colocar

    cluster = colocar.connect(pool=pool_file, token_file=token_file)
    host, stop = cluster.hosts[0], threading.Event()
    busy, batches = colocar.colocated(_busy).on(host), colocar.colocated(_batches).on(host)
    done = [0, 0]  # calls, batches: A's flood is real

    def calls() -> None:
        while not stop.is_set():
            busy(0.002)
            done[0] += 1

    def stream() -> None:
        while not stop.is_set():
            for _ in batches(50):
                done[1] += 1
                if stop.is_set():
                    break

    threads = [threading.Thread(target=calls) for _ in range(FLOOD_THREADS)] + [
        threading.Thread(target=stream)
    ]
    for t in threads:
        t.start()
    print("flooding", flush=True)
    started = time.monotonic()
    sys.stdin.read()
    stop.set()
    for t in threads:
        t.join()
    seconds = time.monotonic() - started
    print(f"flooded {done[0] / seconds:.1f} {done[1] / seconds:.1f}", flush=True)
    cluster.close()


def _measure(cluster: Any, seconds: float) -> dict[str, float]:
    """B's p50/p99 of a trivial call over `seconds`, then its stream's batches/s as long."""
    import colocar

    host = cluster.hosts[0]
    ping, batches = colocar.colocated(lambda: 0).on(host), colocar.colocated(_batches).on(host)
    latencies, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.perf_counter()
        ping()
        latencies.append(time.perf_counter() - started)
    latencies.sort()
    got, started = 0, time.monotonic()
    while time.monotonic() - started < seconds:
        for _ in batches(20):
            got += 1
    return {
        "p50_us": latencies[len(latencies) // 2] * 1e6,
        "p99_us": latencies[int(len(latencies) * 0.99)] * 1e6,
        "batches_per_s": got / (time.monotonic() - started),
    }


def _pool(folder: str) -> tuple[str, dict[str, str]]:
    """A one-host pool with tenants a and b in `folder`; (pool file, tenant -> token file)."""
    from colocar.pool import cli
    from colocar.protocol.tokens import new_token, write_token_file

    tokens = {name: os.path.join(folder, f"{name}.token") for name in ("a", "b")}
    for path in tokens.values():
        write_token_file(path, new_token())
    quotas = "{arena: 64M, calls: 32, processes: 1, sessions: 2}"
    with open(os.path.join(folder, "tenants.yaml"), "w") as f:
        f.write(
            "tenants:\n" + "".join(f"  {n}: {{token_file: {n}.token, quotas: {quotas}}}\n" for n in tokens)
        )
    args = cli.build_parser().parse_args(
        ["up", "--hosts", "1", "--tenants", os.path.join(folder, "tenants.yaml"),
         "--dir", os.path.join(folder, "pool"), "--capacity", "128M", "--max-tenants", "2",
         "--idle-seconds", "600", "--lease-seconds", "30", "--address", "127.0.0.1:0",
         "--shm-dir", os.environ.get("COLOCAR_SHM_DIR", "/dev/shm")]
    )  # fmt: skip
    cli.up(args)
    return os.path.join(folder, "pool", "pool.json"), tokens


def _rounds(pool_file: str, tokens: dict[str, str], rounds: int, seconds: float) -> dict[str, list[dict]]:
    import colocar

    out: dict[str, list[dict]] = {"alone": [], "flooded": []}
    with colocar.connect(pool=pool_file, token_file=tokens["b"]) as b:
        _measure(b, 0.3)  # warm: the first stream starts the sidecar's machinery
        for _ in range(rounds):
            out["alone"].append(_measure(b, seconds))
            flood = subprocess.Popen(
                [sys.executable, "-m", "colocar.bench.pool", "flood", pool_file, tokens["a"]],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env(),
            )  # fmt: skip
            try:
                if flood.stdout is None or flood.stdout.readline().strip() != "flooding":
                    raise RuntimeError("tenant A's flood did not start")
                out["flooded"].append(_measure(b, seconds))
            finally:
                said = flood.communicate(timeout=120)[0].split()
            out["flooded"][-1].update(a_calls_per_s=float(said[1]), a_batches_per_s=float(said[2]))
    return out


def run(quick: bool, repeats: int) -> dict[str, Any]:
    from colocar.pool import cli

    rounds, seconds = (min(repeats, 2), 2.0) if quick else (repeats, 5.0)
    with tempfile.TemporaryDirectory(prefix="colocar-bench-pool-") as folder:
        pool_file, tokens = _pool(folder)
        try:
            found = _rounds(pool_file, tokens, rounds, seconds)
        finally:
            cli.down(cli.build_parser().parse_args(["down", "--pool", pool_file]))

    def median(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in found[kind])

    result: dict[str, Any] = {"quick": quick, "rounds": rounds, "seconds_per_phase": seconds}
    for kind in ("alone", "flooded"):
        for key in ("p50_us", "p99_us", "batches_per_s"):
            result[f"{kind}_{key}"] = round(median(kind, key), 1)
    result["a_calls_per_s"] = round(median("flooded", "a_calls_per_s"), 1)  # the flood, as A saw it
    result["a_batches_per_s"] = round(median("flooded", "a_batches_per_s"), 1)
    result["throughput_ratio"] = round(
        median("flooded", "batches_per_s") / median("alone", "batches_per_s"), 3
    )
    result["p99_ratio"] = round(median("flooded", "p99_us") / median("alone", "p99_us"), 3)
    result["throughput_goal"], result["p99_goal"] = THROUGHPUT_GOAL, P99_GOAL
    result["goals_met"] = result["throughput_ratio"] >= THROUGHPUT_GOAL and result["p99_ratio"] <= P99_GOAL
    result["per_round"] = found
    return result


if __name__ == "__main__" and sys.argv[1:2] == ["flood"]:
    _flood(sys.argv[2], sys.argv[3])
