"""The recovery benchmark's rounds and summary: `run(quick, repeats)`, and `round_main`, one
round in a process of its own; what it measures is in the package's docstring
(`colocar/bench/recovery/__init__.py`).
"""

from __future__ import annotations

from colocar.bench import request_cpu_devices

_DEVICES_FLAG = request_cpu_devices(8)  # before JAX starts (`colocar bench` imports this module first)

import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

from colocar.bench import child_env  # noqa: E402
from colocar.bench.ckpt.systems import orbax_checkpointer  # noqa: E402
from colocar.bench.recovery import systems as rs  # noqa: E402

MiB = 1 << 20
POOL = "snap"
SLOWDOWN_FLOOR = 0.02
BLOCKED_FIXED_S = 0.001  # the goal's fixed part of a take's blocked time
GOODPUT_STEPS, GOODPUT_STEP_S, GOODPUT_EVERY = 1000, 0.1, 10  # the run `goodput` models
SYSTEMS = ("ram", "storage", "orbax", "storage_gcs", "orbax_gcs")
BUCKET = "colocar-bench-recovery"
PER_ROUND = (
    "ram_s",
    "storage_s",
    "orbax_s",
    "detect_s",
    "ram_read_s",
    "snapshot_blocked_s",
    "small_snapshot_blocked_s",
    "replication_slowdown",
    "save_slowdown",
)


@dataclass
class Config:
    rows: int
    takes: int
    baseline_s: float
    snap_pool: int  # bytes per host: 2 snapshots kept x (own + 1 replica) x a host's share
    default_pool: int  # bytes per host: a storage save of its share, or two restores' slices


def _mib(n: float) -> int:
    return int(-(-n // MiB) * MiB)


def _kill(cluster: Any, victim: int) -> float:
    """SIGKILLs the victim's sidecar; seconds until its session is marked lost."""
    session = cluster.hosts[victim].connection.session
    t0 = time.monotonic()
    cluster.processes[victim].kill()
    deadline = t0 + 60
    while session.lost is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"host {victim} was not marked lost 60 s after its sidecar was killed")
        time.sleep(0.002)
    detect = time.monotonic() - t0
    cluster.processes[victim].wait(timeout=30)
    return detect


def _recover(name: str, cluster: Any, snaps: Any, m: dict, paths: dict, ckptr: Any, surv: Any) -> float:
    if name == "ram":
        took, m["ram_read_s"] = rs.ram(snaps, surv, m["last_snapshot"])
        return took
    if name.startswith("storage"):
        return rs.storage(cluster, paths[name.replace("storage", "colocar")], surv)
    return rs.orbax(ckptr, paths[name], surv)


def _round(
    r: int, state: dict[str, Any], devices: list[Any], cfg: Config, ckptr: Any, root: str, gcs: Any
) -> dict:
    """One round on a fresh cluster: the costs, the saves, the kill, the five recoveries."""
    import colocar
    from colocar.elastic.snapshots import Snapshots

    victim = 1 + r % 3
    paths = {name: os.path.join(root, f"{name}-{r}") for name in ("colocar", "orbax", "warm")}
    paths.update({f"{name}_gcs": f"gs://{BUCKET}/{name}-{r}" for name in ("colocar", "orbax")})
    left = [d for i, d in enumerate(devices) if i // 2 != victim]
    arena = cfg.snap_pool + cfg.default_pool
    with colocar.local_cluster(
        hosts=rs.HOSTS,
        devices=devices,
        arena_size=arena,
        pools={POOL: cfg.snap_pool},
        processes=0,
        env=gcs.env,
    ) as cluster:
        rs.warm_up(cluster, POOL, paths["warm"], devices, left)
        small = rs.small_snapshot_costs(cluster, devices, POOL, cfg.takes * 10)
        snaps = Snapshots(cluster, replicas=1, pool=POOL)
        try:
            m = {**small, **rs.snapshot_costs(snaps, state, cfg.takes, cfg.baseline_s)}
            m.update(rs.storage_saves(cluster, paths, state, cfg.baseline_s))
            for where in ("orbax", "orbax_gcs"):
                ckptr.save(paths[where], state)
                ckptr.wait_until_finished()
            surv = rs.Survivors.of(state, left)
            gc.collect()
            m["victim"] = victim
            m["detect_s"] = _kill(cluster, victim)
            order = SYSTEMS[r % len(SYSTEMS) :] + SYSTEMS[: r % len(SYSTEMS)]
            for name in order:
                m[f"{name}_restore_s"] = _recover(name, cluster, snaps, m, paths, ckptr, surv)
                m[f"{name}_s"] = m["detect_s"] + m[f"{name}_restore_s"]
                gc.collect()
            m["order"] = "/".join(order)
            del surv
        finally:
            snaps.close()
    for path in paths.values():
        if not path.startswith("gs://"):  # the server's memory goes with it
            shutil.rmtree(path, ignore_errors=True)
    return m


def _summary(head: dict[str, Any], rounds: list[dict], memcpy: float) -> dict[str, Any]:
    def med(key: str) -> float:
        return float(statistics.median(m[key] for m in rounds))

    out = dict(head)
    keys = ("ram_s", "storage_s", "orbax_s", "detect_s", "snapshot_blocked_s", "snapshot_committed_s") + (
        "ram_restore_s",
        "storage_restore_s",
        "orbax_restore_s",
        "storage_gcs_s",
        "orbax_gcs_s",
        "storage_gcs_restore_s",
        "orbax_gcs_restore_s",
        "save_blocked_s",
        "save_durable_s",
        "gcs_save_durable_s",
    )
    for key in keys:
        out[key] = round(med(key), 4)
    out["speedup"] = round(med("storage_s") / med("ram_s"), 2)
    out["orbax_speedup"] = round(med("orbax_s") / med("ram_s"), 2)
    # the same ratios without the loss's detection (common to all three, set by the heartbeat)
    out["restore_speedup"] = round(med("storage_restore_s") / med("ram_restore_s"), 2)
    out["orbax_restore_speedup"] = round(med("orbax_restore_s") / med("ram_restore_s"), 2)
    # from the GCS emulator: colocar's storage tier against RAM and against Orbax on the same store
    out["gcs_speedup"] = round(med("storage_gcs_s") / med("ram_s"), 2)
    out["gcs_orbax_ratio"] = round(med("storage_gcs_restore_s") / med("orbax_gcs_restore_s"), 2)
    out["ram_read_s"] = round(med("ram_read_s"), 4)
    out["memcpy_s"] = round(memcpy, 4)
    out["blocked_ratio"] = round(med("snapshot_blocked_s") / memcpy, 2)
    for key in ("small_snapshot_blocked_s", "small_memcpy_state_s"):
        out[key] = round(med(key), 5)
    out["small_state_mib"] = round(rounds[0]["small_state_bytes"] / MiB, 2)
    # goal: blocked <= 1 ms + 1.2 memcpies of the state (one controller copies every host's share)
    out["small_blocked_goal_s"] = round(BLOCKED_FIXED_S + 1.2 * med("small_memcpy_state_s"), 5)
    for key in ("replication_slowdown", "save_slowdown", "step_ms"):
        out[key] = round(med(key), 3)
    floored = {k: max(med(k), SLOWDOWN_FLOOR) for k in ("replication_slowdown", "save_slowdown")}
    out["slowdown_ratio"] = round(floored["replication_slowdown"] / floored["save_slowdown"], 3)
    for key in PER_ROUND:
        out[f"{key}_per_round"] = [round(m[key], 4) for m in rounds]
    out["order_per_round"] = [m["order"] for m in rounds]
    out["victim_per_round"] = [m["victim"] for m in rounds]
    return out


def goodput(out: dict[str, Any]) -> float:
    """Useful step time over wall time of the modelled run (see the module's docstring)."""
    slow = max(out["replication_slowdown"], 0.0)
    per_snapshot = out["snapshot_blocked_s"] + out["replication_training_s"] * slow / (1 + slow)
    useful = GOODPUT_STEPS * GOODPUT_STEP_S
    lost = GOODPUT_STEPS // GOODPUT_EVERY * per_snapshot + out["ram_s"] + GOODPUT_EVERY / 2 * GOODPUT_STEP_S
    return useful / (useful + lost)


def _config(quick: bool, state: dict[str, Any], share: int) -> Config:
    import jax

    nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
    return Config(
        rows=504 if quick else 8160,
        takes=2 if quick else 3,
        baseline_s=0.25 if quick else 1.0,
        snap_pool=_mib(4 * share + 16 * MiB),
        default_pool=_mib(2 * nbytes / 3 + 32 * MiB),
    )


def round_main(quick: bool, r: int) -> None:
    """One round in a process of its own (`run` starts it): builds the state, measures the
    memcpy, runs the round, prints its figures as JSON on the last line. A process per round
    bounds the peak memory by one round's: with the 3 rounds of 1 GiB in one process its
    resident memory (arenas mapped, state, restored copies, allocator growth) reached 20 GiB
    of this machine's 23, against 14 GiB for one round."""
    import jax

    devices = jax.devices("cpu")
    if len(devices) != 8:
        raise RuntimeError(
            f"the recovery benchmark needs 8 CPU devices, got {len(devices)}: set XLA_FLAGS={_DEVICES_FLAG} "
            "before JAX is imported"
        )
    state = rs.make_state(504 if quick else 8160, devices)
    shares = rs.host_shards(state, devices)
    share = max(sum(s.nbytes for s in host) for host in shares)
    cfg = _config(quick, state, share)
    head = {
        "memcpy_s": rs.memcpy_s(shares[1], 3 if quick else 7),
        "memcpy_state_s": rs.memcpy_s([s for host in shares for s in host], 3),
        "rows": cfg.rows,
        "state_bytes": sum(leaf.nbytes for leaf in jax.tree.leaves(state)),
        "share_bytes": share,
        "snap_pool": cfg.snap_pool,
        "default_pool": cfg.default_pool,
    }
    from colocar.demo.gcs import serve

    root = tempfile.mkdtemp(prefix="colocar-bench-recovery-")
    try:
        with serve(root, BUCKET) as gcs:  # the GCS emulator, for the storage rows on GCS
            ckptr = orbax_checkpointer(state, root)
            try:
                m = _round(r, state, devices, cfg, ckptr, root, gcs)
            finally:
                ckptr.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({**head, **m}), flush=True)


def _spawn(quick: bool, r: int) -> dict:
    """Round `r` in a child process (its stderr goes to ours); its figures."""
    code = f"from colocar.bench.recovery.benchmark import round_main; round_main({quick}, {r})"
    done = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), stdout=subprocess.PIPE, text=True, timeout=1800
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(
            f"recovery round {r} failed (exit {done.returncode}); its output:\n{done.stdout[-3000:]}"
        )
    return dict(json.loads(lines[-1]))


def run(quick: bool, repeats: int) -> dict:
    """Runs the rounds, each in a process of its own, and sums up."""
    rounds = min(repeats, 1) if quick else repeats
    results = [_spawn(quick, r) for r in range(rounds)]
    first = results[0]
    layout = (
        f"{rs.LAYERS} x {{w: f32[{first['rows']},{rs.COLS}] P(data), b: f32[{rs.COLS}] P()}}, 4 x 2 devices"
    )
    head: dict[str, Any] = {
        "benchmark": "recovery",
        "quick": quick,
        "rounds": rounds,
        "state": layout,
        "state_mib": round(first["state_bytes"] / MiB, 1),
        "host_share_mib": round(first["share_bytes"] / MiB, 1),
        "snap_pool_mib": first["snap_pool"] // MiB,
        "default_pool_mib": first["default_pool"] // MiB,
    }
    memcpy = statistics.median(m["memcpy_s"] for m in results)
    out = _summary(head, results, memcpy)
    out["memcpy_state_s"] = round(statistics.median(m["memcpy_state_s"] for m in results), 4)
    out["snapshot_blocked_goal_s"] = round(BLOCKED_FIXED_S + 1.2 * out["memcpy_state_s"], 4)
    # goal <= 1.5: the restore itself (no step) against one memcpy of the state
    out["ram_read_memcpy_ratio"] = round(out["ram_read_s"] / out["memcpy_state_s"], 2)
    out["replication_training_s"] = round(statistics.median(m["replication_training_s"] for m in results), 4)
    out["goodput"] = round(goodput(out), 4)
    out["load_avg_1m"] = round(os.getloadavg()[0], 1)
    return out
